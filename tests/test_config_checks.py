"""Every input checked up front by one rule (issue 51): a flag, a YAML file and a config built in
Python are refused with the same message naming the field and its flag (fields.check_fields);
`plan`'s description of a machine is checked as argparse reads it; a --config file is read safely
(no aliases) and strictly (no key twice, a directory named as one); and output into a pipe whose
reader has gone ends quietly."""
from __future__ import annotations

import contextlib
import io
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from slidetune import cli, run_setup
from slidetune.cli import build_parser, main
from slidetune.config import TrainConfig, config_from_args, config_to_dict
from slidetune.data.config import DataConfig
from slidetune.engine.adamw import AdamWConfig
from slidetune.engine.config import RuntimeConfig, recompute_set

TRAIN = ["--model", "tiny-llama", "--seq-len", "32", "--batch-size", "2", "--max-steps", "1", "--progress", "false",
         "--device", "cpu"]


def run_main(*args: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(args))
        except SystemExit as e:          # argparse: usage errors
            code = e.code
    return code, out.getvalue(), err.getvalue()


@pytest.fixture
def no_model(monkeypatch):
    """A refusal must come before the model loads."""
    def forbidden(*a, **k):
        raise AssertionError("must be refused before the model loads")
    monkeypatch.setattr(run_setup, "load_model", forbidden)


def refused(tmp_path, *args: str, command: str = "train") -> str:
    """The command exits 2 with a one-line error, no traceback, and writes no output directory."""
    out_dir = ["--output-dir", str(tmp_path / "never")] if command == "train" and "--output-dir" not in args else []
    code, out, err = run_main(command, *(TRAIN if command == "train" else ["--model", "tiny-llama"]), *out_dir, *args)
    assert code == 2, (out[-2000:], err[-2000:])
    assert "error" in err and "Traceback" not in err and len(err) < 3000, err[-3000:]
    assert not (tmp_path / "never").exists()
    return err


# ----------------------------------------------------------------------------- one rule for flags, YAML and Python
# (field as TrainConfig takes it from Python, its value, the flag and its text)
SAME_RULE = [
    ({"batch_size": 0}, ["--batch-size", "0"]),
    ({"num_layers": 0}, ["--num-layers", "0"]),
    ({"seed": -1}, ["--seed", "-1"]),
    ({"min_lr_ratio": math.nan}, ["--min-lr-ratio", "nan"]),
    ({"gpu_memory_limit": math.inf}, ["--gpu-memory-limit", "inf"]),
    ({"output_dir": ""}, ["--output-dir", ""]),
    ({"model": " "}, ["--model", " "]),
    ({"data": {"seq_len": 0}}, ["--seq-len", "0"]),
    ({"optim": {"lr": -1.0}}, ["--lr", "-1"]),
    ({"runtime": {"recompute": "banana"}}, ["--recompute", "banana"]),
    ({"runtime": {"mode": "ckpt", "recompute": "every:0"}}, ["--mode", "ckpt", "--recompute", "every:0"]),
    ({"runtime": {"recompute": "0,-1"}}, ["--recompute", "0,-1"]),
    ({"runtime": {"device": "banana"}}, ["--device", "banana"]),
    ({"runtime": {"device": "cuda:x"}}, ["--device", "cuda:x"]),
]


@pytest.mark.parametrize("python, flags", SAME_RULE)
def test_python_and_the_flags_get_the_same_refusal(python, flags):
    with pytest.raises(ValueError) as from_python:
        TrainConfig(**python)
    with pytest.raises(ValueError) as from_flags:
        config_from_args(build_parser().parse_args(["train", *flags]))
    assert str(from_python.value) == str(from_flags.value)
    flag = next(f for f in flags[::-1] if f.startswith("--"))
    assert flag in str(from_flags.value), str(from_flags.value)


@pytest.mark.parametrize("python, flags", SAME_RULE)
def test_a_yaml_file_gets_the_same_refusal_naming_the_file(tmp_path, python, flags):
    f = tmp_path / "c.yaml"
    f.write_text(json.dumps(python))                  # JSON is YAML (inf as Infinity, which YAML reads as a string)
    with pytest.raises(ValueError) as from_python:
        TrainConfig(**python)
    with pytest.raises(ValueError) as from_file:
        config_from_args(build_parser().parse_args(["train", "--config", str(f)]))
    assert str(from_file.value) == f"config file {f}: {from_python.value}"


def test_recompute_banana_is_refused_in_every_mode_naming_the_flag(tmp_path, no_model):
    for mode in ("slide", "ckpt"):        # slide trained (exit 0); ckpt: "invalid literal for int()" after loading
        err = refused(tmp_path, "--mode", mode, "--recompute", "banana")
        assert "--recompute" in err and "'banana'" in err and "invalid literal" not in err, err
        assert all(form in err for form in ("all", "none", "every:K", '"0,3,7"')), err


def test_recompute_values_are_read_once_in_one_spelling():
    assert RuntimeConfig(recompute=" 3, 0,3 ").recompute == "0,3"
    assert RuntimeConfig(recompute="Every:2").recompute == "every:2"
    assert RuntimeConfig(recompute="").recompute == "all"
    assert recompute_set("every:2", 5) == {0, 2, 4} and recompute_set("none", 4) == set()
    with pytest.raises(ValueError, match=r"--recompute names layers \[7\], but the model's layers are 0..3"):
        recompute_set("1,7", 4)


def test_an_empty_output_dir_is_refused_and_writes_nothing(tmp_path, monkeypatch, no_model):
    monkeypatch.chdir(tmp_path)
    err = refused(tmp_path, "--output-dir", "")
    assert "output_dir" in err and "--output-dir" in err and '".": the working directory' in err, err
    assert list(tmp_path.iterdir()) == []                       # no final/, checkpoints/, metrics.csv here


def test_a_flag_that_does_not_parse_names_its_type(tmp_path):
    err = refused(tmp_path, "--batch-size", "x")
    assert "argument --batch-size: invalid int value: 'x'" in err, err            # not "<lambda>"


# ----------------------------------------------------------------------------- Python's types
@pytest.mark.parametrize("build, words", [
    (lambda: TrainConfig(batch_size="2"), ["batch_size", "an int", "str '2'", "--batch-size"]),
    (lambda: TrainConfig(max_steps=True), ["max_steps", "an int or None", "bool True"]),
    (lambda: TrainConfig(max_steps=10.0), ["max_steps", "an int or None", "float 10.0"]),
    (lambda: DataConfig(seq_len="x"), ["seq_len", "an int", "str 'x'", "--seq-len"]),
    (lambda: TrainConfig(data={"seq_len": "x"}), ["seq_len", "an int", "str 'x'"]),
    (lambda: AdamWConfig(lr="1e-4"), ["lr", "a number", "str '1e-4'", "--lr"]),
    (lambda: TrainConfig(progress="no"), ["progress", "a bool", "str 'no'"]),
    (lambda: RuntimeConfig(chunk_mb="64"), ["chunk_mb", "an int", "--tuning.chunk_mb"]),
    (lambda: RuntimeConfig(disk_units="x"), ["disk_units", "a number", "--tuning.disk_units"]),
    (lambda: TrainConfig(data=3), ["data", "DataConfig", "a path", "int 3"]),
    (lambda: TrainConfig(model=None), ["model", "a str", "NoneType None"])])
def test_a_value_of_the_wrong_type_names_the_field_and_the_type(build, words):
    with pytest.raises(TypeError) as e:         # a TypeError, and a ValueError as every other refusal
        build()
    assert isinstance(e.value, ValueError)
    assert all(w in str(e.value) for w in words), str(e.value)


def test_python_gets_the_conveniences_a_yaml_file_has(tmp_path):
    cfg = TrainConfig(data="train.jsonl", seed=3)                   # as `--data train.jsonl`, `data: train.jsonl`
    assert cfg.data == DataConfig(path="train.jsonl", seed=3)
    cfg = TrainConfig(data=tmp_path / "t.jsonl", output_dir=tmp_path / "run", runtime={"chunk_mb": 64}, optim={"lr": 1})
    assert cfg.data.path == str(tmp_path / "t.jsonl") and cfg.output_dir == str(tmp_path / "run")
    assert cfg.runtime.transfer.chunk_mb == 64 and cfg.optim.lr == 1
    json.dumps(config_to_dict(cfg))                                  # paths saved as text in config.json
    assert TrainConfig(data=None).data == DataConfig() and TrainConfig(progress=0).progress is False


# ----------------------------------------------------------------------------- plan's machine
@pytest.mark.parametrize("flag, value", [
    ("--gpu-free-gib", "-5"), ("--gpu-free-gib", "nan"), ("--gpu-free-gib", "inf"), ("--gpu-free-gib", "0"),
    ("--host-gib", "-1"), ("--host-gib", "nan"), ("--shm-gib", "-1"), ("--shm-gib", "x"),
    ("--disk-free-gib", "-0.5"), ("--disk-free-gib", "nan"), ("--gpus", "0"), ("--gpus", "1.5"), ("--gpus", "-2")])
def test_plan_refuses_a_machine_that_cannot_be_naming_the_argument(tmp_path, flag, value):
    err = refused(tmp_path, "--device", "cuda", "--gpu-free-gib", "20", flag, value, command="plan")
    assert f"argument {flag}:" in err and repr(value) in err, err


def test_plan_takes_a_full_disk_and_shm(tmp_path):
    """(A guard: 0 GiB free is a state to plan against, not a machine that cannot be.)"""
    code, out, err = run_main("plan", "--model", "tiny-llama", "--device", "cpu", "--host-gib", "8",
                              "--shm-gib", "0", "--disk-free-gib", "0", "--no-limits")
    assert code == 0, err


def test_train_refuses_gpus_0_as_plan_does(tmp_path):
    err = refused(tmp_path, "--gpus", "0")
    assert "argument --gpus: must be a whole number of ranks >= 1, not '0'" in err, err


# ----------------------------------------------------------------------------- the config file
def test_a_yaml_alias_bomb_is_refused_at_its_first_alias(tmp_path, no_model):
    """Nested anchors (the "billion laughs"): 10^5 values here, 9^9 in the issue's, which ran out
    of memory quoting them; refused at the first alias, naming the line."""
    lines = ["model:", '  - &a0 ["lol","lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    lines += [f"  - &a{i} [{','.join([f'*a{i - 1}'] * 10)}]" for i in range(1, 5)]
    f = tmp_path / "bomb.yaml"
    f.write_text("\n".join(lines) + "\n")
    err = refused(tmp_path, "--config", str(f))
    assert f"config file {f}: line 3: the YAML alias *a0 is not accepted" in err, err


def test_a_key_given_twice_is_refused_naming_the_key_and_its_lines(tmp_path, no_model):
    f = tmp_path / "dup.yaml"
    f.write_text("lr: 1e-4\nbatch_size: 2\nlr: 2e-4\n")
    err = refused(tmp_path, "--config", str(f))
    assert f"config file {f}: line 3: the key 'lr' is given twice in one mapping (first on line 1)" in err, err
    f.write_text("tuning:\n  chunk_mb: 64\n  upload_ring: 2\n  chunk_mb: 32\n")
    err = refused(tmp_path, "--config", str(f))
    assert "line 4: the key 'chunk_mb' is given twice" in err and "first on line 2" in err, err
    f.write_text('{"seed": 1, "seed": 2}')                               # a JSON file too
    assert "the key 'seed' is given twice" in refused(tmp_path, "--config", str(f))


def test_a_directory_given_as_config_is_named_as_one(tmp_path, no_model):
    d = tmp_path / "run"
    d.mkdir()
    err = refused(tmp_path, "--config", str(d))
    assert f"config file {d} is a directory" in err and "does not exist" not in err, err
    (d / "config.json").write_text("{}")
    assert f"--config {d / 'config.json'}" in refused(tmp_path, "--config", str(d))


def test_a_config_nested_too_deeply_is_refused(tmp_path, no_model):
    f = tmp_path / "deep.yaml"
    f.write_text("seed: " + "[" * 50000 + "]" * 50000 + "\n")
    assert "nests its values too deeply" in refused(tmp_path, "--config", str(f))


def test_an_anchor_without_an_alias_and_a_pipe_still_read():
    """An anchor alone expands nothing; a pipe is `--config <(generate-config)`."""
    read, write = os.pipe()
    os.write(write, b"seed: &s 3\nbatch_size: 2\n")
    os.close(write)
    try:
        cfg = config_from_args(build_parser().parse_args(["train", "--config", f"/dev/fd/{read}"]))
    finally:
        os.close(read)
    assert cfg.seed == 3 and cfg.batch_size == 2


# ----------------------------------------------------------------------------- a closed pipe
def closed_pipe_run(*args: str) -> subprocess.CompletedProcess:
    """`slidetune ARGS | head` where head has already gone: stdout is a pipe with no reader."""
    read, write = os.pipe()
    os.close(read)
    try:
        return subprocess.run([sys.executable, "-m", "slidetune.cli", *args], stdout=write, stderr=subprocess.PIPE,
                              text=True, timeout=300, cwd=Path(__file__).parent)
    finally:
        os.close(write)


def test_output_into_a_closed_pipe_ends_quietly(monkeypatch):
    for args in (["train", "--help-tuning"], ["plan", "--model", "tiny-llama", "--device", "cpu", "--no-limits"]):
        done = closed_pipe_run(*args)
        assert done.stderr == "" and done.returncode == 141, done.stderr[-3000:]   # as SIGPIPE ends a Unix tool
    # a BrokenPipeError from anything but stdout (a tracker's socket) is still an error
    def plan(ns):
        raise BrokenPipeError(32, "a tracker's socket went away")
    monkeypatch.setattr(cli, "_plan", plan)
    code, _, err = run_main("plan")
    assert code == 2 and "BrokenPipeError" in err and "tracker's socket" in err, err
