"""The parallel checkpoint writer (checkpoint/io.py): the files byte for byte those of the serial
writer it replaced, the same digests, and a failing writer thread leaving the previous checkpoint."""
from __future__ import annotations

import errno
import json
import os
import struct
import threading
import time
from pathlib import Path

import pytest
import torch
import xxhash
from safetensors.torch import load_file

import slidetune.checkpoint.io as io_mod
import slidetune.checkpoint.writer as writer_mod
from slidetune.checkpoint import (MANIFEST, CheckpointCorrupt, CheckpointError, FileDigest, checkpoint_dir,
                                  check_checkpoint, file_digest, load_checkpoint, optimizer_files, save_checkpoint,
                                  verify_files, write_safetensors)
from slidetune.checkpoint.format import ST_DTYPES
from slidetune.engine.slide.disk_tier import StreamedTensor
from test_checkpoint import make_engine, train

_OLD_WRITE_BYTES = 256 * 2**20


def old_write_safetensors(tensors, path, dtype=None, metadata=None, **_io) -> FileDigest:
    """The serial writer as it was before the parallel one (commit dbd7cf0), the reference."""
    entries, offset = [], 0
    for name, t in tensors.items():
        dt = dtype or t.dtype
        n = t.numel() * torch.empty((), dtype=dt).element_size()
        entries.append((name, t, dt, offset, offset + n))
        offset += n
    header = {name: {"dtype": ST_DTYPES[dt], "shape": list(t.shape), "data_offsets": [lo, hi]}
              for name, t, dt, lo, hi in entries}
    header["__metadata__"] = dict(metadata or {"format": "pt"})
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    h, size = xxhash.xxh3_128(), 0
    with open(path, "wb") as f:
        def write(b):
            nonlocal size
            f.write(b)
            h.update(b)
            size += memoryview(b).nbytes
        write(struct.pack("<Q", len(text)))
        write(text)
        for name, t, dt, lo, hi in entries:
            if isinstance(t, StreamedTensor):
                for part in t.chunks():
                    write(memoryview(part.to(dt).contiguous().view(torch.uint8).numpy()))
                continue
            src = t.detach()
            if src.device.type != "cpu" or src.dtype != dt:
                src = src.to("cpu", dt)
            raw = src.contiguous().reshape(-1).view(torch.uint8).numpy()
            for start in range(0, raw.size, _OLD_WRITE_BYTES):
                write(memoryview(raw[start:start + _OLD_WRITE_BYTES]))
    return FileDigest(size, h.hexdigest())


@pytest.fixture
def small_pieces(monkeypatch):
    """Pieces, casts and reads of a few KiB: a small tensor set crosses every boundary and keeps
    several threads busy at once."""
    monkeypatch.setattr(io_mod, "WRITE_PIECE", 4096)
    monkeypatch.setattr(io_mod, "INLINE_BYTES", 1024)
    monkeypatch.setattr(io_mod, "STAGE_BYTES", 3 * 4096 + 8)
    monkeypatch.setattr(io_mod, "READ_PIECE", 5000)


def mixed_tensors() -> dict:
    g = torch.Generator().manual_seed(0)
    base = torch.randn(300, 77, generator=g)
    blocks = [torch.randn(1000, generator=g) for _ in range(3)]
    return {
        "big": torch.randn(50_000, generator=g),
        "scalar": torch.tensor(7.0),
        "empty": torch.empty(0, 4),
        "strided": base.t(),                            # not contiguous
        "view": base[10:200],
        "int": torch.arange(1000, dtype=torch.int64),
        "streamed": StreamedTensor((3000,), torch.float32, lambda: iter(blocks)),
        "tiny": torch.ones(3),
    }


@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
@pytest.mark.parametrize("threads", [1, 3])
def test_bytes_and_digest_as_the_serial_writer(tmp_path, small_pieces, dtype, threads):
    tensors = mixed_tensors()
    if dtype is not None:
        tensors = {k: v for k, v in tensors.items() if k != "int"}
    want = old_write_safetensors(tensors, tmp_path / "old.safetensors", dtype=dtype)
    got = write_safetensors(tensors, tmp_path / "new.safetensors", dtype=dtype, threads=threads)
    assert (tmp_path / "new.safetensors").read_bytes() == (tmp_path / "old.safetensors").read_bytes()
    assert got == want == file_digest(tmp_path / "old.safetensors")
    assert io_mod.digests_parallel([tmp_path / "new.safetensors"], threads)[tmp_path / "new.safetensors"] == want


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_gpu_tensors_staged_through_pinned_buffers_write_the_host_bytes(tmp_path, small_pieces, dtype):
    """The Stager's path (a GPU-held master or moment): chunks of a few KiB through the two pinned
    buffers, the cast to BF16 on the GPU, strided and empty tensors: the host tensors' bytes."""
    host = {k: v for k, v in mixed_tensors().items() if k != "streamed" and not (dtype and k == "int")}
    on_gpu = {k: v.cuda() for k, v in host.items()}
    on_gpu["later"] = torch.zeros(40_000, device="cuda")
    on_gpu["later"].add_(1.5)                 # written by a kernel the stager's side stream must wait for
    host["later"] = torch.full((40_000,), 1.5)
    want = old_write_safetensors(host, tmp_path / "old.safetensors", dtype=dtype)
    got = write_safetensors(on_gpu, tmp_path / "new.safetensors", dtype=dtype, threads=3)
    assert (tmp_path / "new.safetensors").read_bytes() == (tmp_path / "old.safetensors").read_bytes()
    assert got == want


def test_read_back_digest_of_files_of_every_size(tmp_path, small_pieces):
    paths = []
    for n in (0, 1, 4999, 5000, 5001, 20_000, 123_457):
        p = tmp_path / f"f{n}"
        p.write_bytes(os.urandom(n))
        paths.append(p)
    got = io_mod.digests_parallel(paths, 3)
    assert all(got[p] == file_digest(p) for p in paths)


def save_fixed_time(eng, out: Path, **kw) -> Path:
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(time, "time", lambda: 1_700_000_000.0)          # state.json's time, the same in both
        return save_checkpoint(eng, out, step=2, trainer_state={"x": 1}, **kw)


@pytest.mark.parametrize("runtime", [{}, {"device_layers": 2}], ids=["host", "device-layers"])
def test_whole_checkpoint_byte_identical_to_the_serial_writer(tmp_path, small_pieces, monkeypatch, runtime):
    """Every file of a checkpoint (the MANIFEST and COMPLETE included, state.json's time fixed)
    is the serial writer's, weight shards and optimizer file alike; it loads and checks."""
    eng = make_engine(runtime=runtime)
    train(eng, range(2))
    new = save_fixed_time(eng, tmp_path / "new", max_shard_bytes=40_000, writer_threads=3)
    monkeypatch.setattr(writer_mod, "write_safetensors", old_write_safetensors)
    old = save_fixed_time(eng, tmp_path / "old", max_shard_bytes=40_000)
    files = sorted(p.relative_to(new).as_posix() for p in new.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(old).as_posix() for p in old.rglob("*") if p.is_file())
    assert any(f.startswith("model-00002-of-") for f in files)          # several shards
    for rel in files:
        assert (new / rel).read_bytes() == (old / rel).read_bytes(), rel
    assert check_checkpoint(new).verified
    load_checkpoint(make_engine(runtime=runtime), new)


@pytest.mark.parametrize("runtime", [{}, {"device_layers": 2}], ids=["host", "device-layers"])
def test_a_large_optimizer_state_goes_out_in_two_parts_that_load_back(tmp_path, small_pieces, monkeypatch, runtime):
    """Above OPTIM_PARTS_FROM_BYTES the moments are two files of about equal bytes, written beside
    the weights at once: together the one file's tensors bit for bit, the weights unchanged, and a
    resume loads them."""
    eng = make_engine(runtime=runtime)
    train(eng, range(2))
    one = save_fixed_time(eng, tmp_path / "one", max_shard_bytes=40_000, writer_threads=3)
    monkeypatch.setattr(writer_mod, "OPTIM_PARTS_FROM_BYTES", 1)
    streams: dict[str, float] = {}
    parts = save_fixed_time(eng, tmp_path / "parts", max_shard_bytes=40_000, writer_threads=3, stream_s=streams)
    state_dir = parts / "trainer_state"
    names = [state_dir / f"optimizer-0000{i}-of-00002.safetensors" for i in (1, 2)]
    assert streams.keys() == {"weights", names[0].name, names[1].name}      # three streams, each timed
    assert optimizer_files(parts) == names and not (state_dir / "optimizer.safetensors").exists()
    first, second = (load_file(str(p)) for p in names)
    whole = load_file(str(one / "trainer_state" / "optimizer.safetensors"))
    assert not first.keys() & second.keys() and (first | second).keys() == whole.keys()
    assert all(torch.equal((first | second)[k], whole[k]) for k in whole)
    sizes = [p.stat().st_size for p in names]
    assert min(sizes) > 0.3 * sum(sizes)                            # about half each
    for rel in (p.relative_to(one) for p in one.glob("model*")):    # the weights as before
        assert (parts / rel).read_bytes() == (one / rel).read_bytes()
    assert check_checkpoint(parts).verified
    back = make_engine(runtime=runtime, seed=5)
    load_checkpoint(back, parts)
    back.synchronize()
    assert {k: t.clone() for k, t in back.optimizer_tensors().items()}.keys() == whole.keys()
    assert all(torch.equal(t, whole[k]) for k, t in back.optimizer_tensors().items())


def test_the_optimizer_files_name_what_is_wrong(tmp_path):
    sdir = tmp_path / "trainer_state"
    sdir.mkdir()

    def files(*names):
        for p in sdir.iterdir():
            p.unlink()
        for name in names:
            (sdir / name).write_bytes(b"")
        with pytest.raises(CheckpointCorrupt) as info:
            optimizer_files(tmp_path)
        return info.value.file.name, info.value.what
    assert files() == ("optimizer.safetensors", "missing (state.json says the optimizer state was saved)")
    assert files("optimizer-00001-of-00003.safetensors", "optimizer-00003-of-00003.safetensors") == \
        ("optimizer-00002-of-00003.safetensors", "missing (the optimizer state is in 3 parts)")
    name, what = files("optimizer.safetensors", "optimizer-00001-of-00001.safetensors")
    assert name == "optimizer-00001-of-00001.safetensors" and "never both" in what
    name, what = files("optimizer-00001-of-00001.safetensors", "optimizer-00002-of-00003.safetensors")
    assert name == "optimizer-00002-of-00003.safetensors" and "not one of the optimizer state's 1 parts" in what


@pytest.mark.parametrize("optim_parts", [1, 2])
def test_a_failing_writer_thread_keeps_the_previous_checkpoint(tmp_path, small_pieces, monkeypatch, optim_parts):
    """One pwrite of one of the pool's threads fails (ENOSPC) while the streams write (the weights
    and the optimizer state in one or two files): the save raises, the temporary directory is
    gone, the previous checkpoint is whole and verifies."""
    if optim_parts == 2:
        monkeypatch.setattr(writer_mod, "OPTIM_PARTS_FROM_BYTES", 1)
    eng = make_engine()
    train(eng, range(2))
    first = save_checkpoint(eng, checkpoint_dir(tmp_path, 2), step=2, writer_threads=3)
    before = {p.relative_to(first): p.read_bytes() for p in first.rglob("*") if p.is_file()}
    train(eng, range(2, 3))
    real, calls = io_mod._pwrite_all, []

    def failing(fd, data, offset):
        if threading.current_thread().name.startswith("slidetune-ckpt-io"):      # one of the pool's
            calls.append(offset)
        if len(calls) == 7:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd, data, offset)
    monkeypatch.setattr(io_mod, "_pwrite_all", failing)
    with pytest.raises(CheckpointError) as info:
        save_checkpoint(eng, checkpoint_dir(tmp_path, 3), step=3, writer_threads=3)
    assert "intact" in str(info.value) and str(first) in str(info.value)
    assert isinstance(info.value.__cause__, OSError) and info.value.__cause__.errno == errno.ENOSPC
    assert sorted(p.name for p in tmp_path.iterdir()) == [first.name]
    assert {p.relative_to(first): p.read_bytes() for p in first.rglob("*") if p.is_file()} == before
    assert verify_files(first)


def test_run_streams_raises_the_stream_that_failed_not_those_it_stopped():
    """Three streams at once: the one that fails sets `cancel`, the others stop at their next piece
    with a StreamCancelled, and the failure itself is what run_streams raises, from any stream."""
    def stopped_by(cancel):
        def stream():
            while not cancel.wait(0.01):
                pass
            raise io_mod.StreamCancelled("stopped")
        return stream

    def failing():
        time.sleep(0.05)
        raise OSError(errno.ENOSPC, "No space left on device")
    for failing_first in (False, True):
        cancel = threading.Event()
        first = failing if failing_first else stopped_by(cancel)
        others = [stopped_by(cancel), stopped_by(cancel) if failing_first else failing]
        with pytest.raises(OSError, match="No space left"):
            io_mod.run_streams(first, others, cancel)
        assert cancel.is_set()
    assert io_mod.run_streams(lambda: {"w": 1}, [lambda: "a", lambda: "b"], threading.Event()) == ({"w": 1}, ["a", "b"])


def test_the_read_back_names_a_damaged_file(tmp_path):
    eng = make_engine()
    train(eng, range(1))
    ckpt = save_checkpoint(eng, checkpoint_dir(tmp_path, 1), step=1, writer_threads=2)
    target = ckpt / "trainer_state" / "optimizer.safetensors"
    data = bytearray(target.read_bytes())
    data[-5] ^= 0xFF
    target.write_bytes(bytes(data))
    with pytest.raises(CheckpointCorrupt) as info:
        verify_files(ckpt, threads=2)
    assert info.value.file == target and MANIFEST in str(info.value)
