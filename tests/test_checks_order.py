"""Checks in the order of their cost: the data (path, format, every record parsed) before the model
is loaded, the reference check after it. A bad --data is refused in seconds, not after the model.

The runs use the default model (the embedded SmolLM2-135M, whose load and reference check take
tens of seconds on 2 CPU cores): each refusal must come before either, timed.
"""
from __future__ import annotations

import time

import pytest

from test_train_e2e import run_cli


@pytest.mark.parametrize("name, content, expected", [
    ("missing.jsonl", None, "does not exist"),
    ("bad.jsonl", '{"text": "one"}\n{"text": "two"\n', "bad.jsonl:2: malformed JSON"),
    ("data.docx", "a,b\n", "unknown data file type"),
    ("data.csv", "a,b\n1,2\n", "data.csv row 1: keys ['a', 'b'] match no known format"),   # read with datasets
])
def test_bad_data_is_refused_before_the_model_is_loaded(tmp_path, name, content, expected):
    path = tmp_path / name
    if content is not None:
        path.write_text(content)
    t0 = time.perf_counter()
    code, out, err = run_cli("--data", str(path), "--output-dir", str(tmp_path / "run"), "--progress", "false")
    elapsed = time.perf_counter() - t0
    assert code == 2 and str(path) in err and expected in err, err
    assert "reference check" not in out           # nothing about the model: it was never loaded
    assert elapsed < 10, f"refused after {elapsed:.1f} s"
    assert not (tmp_path / "run").exists()
