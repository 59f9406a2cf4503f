"""The compile-worker pool that torch.compile starts is released after a step that compiled."""
from __future__ import annotations

import pytest
import torch

from slidetune.engine.compile_workers import release_compile_workers

async_compile = pytest.importorskip("torch._inductor.async_compile")


def test_release_without_a_pool_is_a_no_op():
    async_compile.shutdown_compile_workers()
    assert release_compile_workers() is False


def test_release_shuts_down_a_running_pool():
    # A two-worker pool, as inductor's warm-up starts it (one worker per core on the GPU host);
    # inductor's own config.patch (a monkeypatch's undo breaks its config module).
    with torch._inductor.config.patch(compile_threads=2):
        pool = async_compile.AsyncCompile.process_pool()
    assert pool in async_compile._pool_set
    assert release_compile_workers() is True
    assert not async_compile._pool_set                       # nothing left running
    assert release_compile_workers() is False
