"""`slidetune eval` (evaluation/harness.py): lm-evaluation-harness is an optional extra, not installed for the
tests; the command refuses with the install line (the real import check), after checking its
arguments: a missing or incomplete model directory, no task, a bad --limit or --batch-size, each named.
"""
from __future__ import annotations

import contextlib
import importlib.util
import io
from pathlib import Path

import pytest
from transformers import AutoModelForCausalLM

from slidetune.cli import main
from slidetune.models.presets import tiny_config


def run_eval(*args: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["eval", *args])
    return code, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("model") / "final"
    AutoModelForCausalLM.from_config(tiny_config("llama", vocab_size=256, layers=1)).save_pretrained(path)
    return path


@pytest.mark.skipif(importlib.util.find_spec("lm_eval") is not None, reason="lm_eval is installed here")
def test_without_lm_eval_the_command_gives_the_install_line(model_dir):
    code, out, err = run_eval("--model", str(model_dir), "--tasks", "hellaswag,arc_easy")
    assert code == 2 and out == ""
    assert "lm-evaluation-harness (lm_eval), which is not installed" in err
    assert "pip install 'slidetune[eval]'" in err


@pytest.mark.parametrize("args,message", [
    (["--model", "{missing}", "--tasks", "hellaswag"], "--model {missing}: no such directory"),
    (["--model", "{empty}", "--tasks", "hellaswag"], "--model {empty}: no config.json there"),
    (["--model", "{model}", "--tasks", " , "], "--tasks ' , ': name at least one"),
    (["--model", "{model}", "--tasks", "hellaswag", "--limit", "0"], "--limit must be > 0"),
    (["--model", "{model}", "--tasks", "hellaswag", "--batch-size", "big"],
     "--batch-size must be a number > 0 or auto"),
])
def test_bad_arguments_are_named_before_anything_loads(tmp_path, model_dir, args, message):
    (tmp_path / "empty").mkdir()
    names = {"missing": tmp_path / "missing", "empty": tmp_path / "empty", "model": model_dir}
    code, _, err = run_eval(*[a.format(**names) for a in args])
    assert code == 2
    assert message.format(**names) in err


def test_weights_are_required(tmp_path, model_dir):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text((model_dir / "config.json").read_text())
    code, _, err = run_eval("--model", str(tmp_path / "m"), "--tasks", "hellaswag")
    assert code == 2 and "no *.safetensors weights there" in err
