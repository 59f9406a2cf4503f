"""Kill -9 anywhere: a run killed at 20 seeded random moments, during steps and during saves,
continues each time with `--resume auto` from its newest complete checkpoint (never from a
temporary directory) and ends with the weights of an uninterrupted run, bit for bit.

One chain of processes: start, kill, resume, kill again... The model is a 2-layer Llama of
vocabulary 320 with its own small BPE tokenizer in a HF directory: each process starts in
seconds (the embedded GGUF tokenizer alone takes 20 s) and saves a checkpoint a step.
"""
from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import slidetune
from slidetune.data.corpus import builtin_corpus

SRC = str(Path(slidetune.__file__).resolve().parents[1])      # this checkout's package, in the subprocesses
KILLS = 20
STEPS = 60
RESUMED = re.compile(r"resumed from (\S+) at step (\d+) of")
CKPT = re.compile(r"^checkpoint-(\d+)$")


@pytest.fixture(scope="module")
def tiny_run_inputs(tmp_path_factory):
    """A HF model directory (random 2-layer Llama, trained-in-seconds BPE tokenizer) and a small text file."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    from slidetune.models.presets import tiny_config
    root = tmp_path_factory.mktemp("kill9")
    text = "\n\n".join(builtin_corpus()[:40]) + "\n"
    data = root / "small.txt"
    data.write_text(text)
    core = Tokenizer(models.BPE(unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    core.train_from_iterator([text], trainers.BpeTrainer(vocab_size=320, special_tokens=["<unk>", "<s>", "</s>"],
                                                         initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                  pad_token="</s>")
    model_dir = root / "model"
    AutoModelForCausalLM.from_config(tiny_config("llama", vocab_size=len(tok), layers=2)).save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    return model_dir, data


def command(inputs, out: Path, *extra: str) -> list[str]:
    model_dir, data = inputs
    return [sys.executable, "-m", "slidetune.cli", "train", "--model", str(model_dir), "--data", str(data),
            "--seq-len", "16", "--batch-size", "2", "--eval-batches", "1", "--max-steps", str(STEPS),
            "--save-every", "1", "--keep-last", "2", "--progress", "false", "--device", "cpu",
            "--output-dir", str(out), *extra]


def start(cmd: list[str], log: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")])}
    env.pop("SLIDETUNE_INJECT_FAULT", None)
    with log.open("w") as f:
        return subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)


def complete_steps(ckpt_dir: Path) -> list[int]:
    if not ckpt_dir.is_dir():
        return []
    return sorted(int(m.group(1)) for p in ckpt_dir.iterdir()
                  if (m := CKPT.match(p.name)) and (p / "COMPLETE").exists())


def saving(out: Path, pid: int) -> bool:
    """A save of process `pid` is under way: its `.tmp-<pid>` directory exists (checkpoint or final/)."""
    tag = f".tmp-{pid}"
    return any(d.is_dir() and any(p.name.endswith(tag) for p in d.iterdir()) for d in (out / "checkpoints", out)
               if d.is_dir())


def wait_for(cond, proc: subprocess.Popen, timeout_s: float = 180.0) -> bool:
    """Poll `cond` every 2 ms; False if the process ended first."""
    t0 = time.monotonic()
    while not cond():
        if proc.poll() is not None:
            return False
        assert time.monotonic() - t0 < timeout_s, "the training process made no progress"
        time.sleep(0.002)
    return True


@pytest.mark.slow
def test_kill_9_at_20_random_moments_then_resume_auto_ends_with_the_uninterrupted_weights(tiny_run_inputs, tmp_path):
    rng = random.Random(22)
    ref = tmp_path / "uninterrupted"
    assert subprocess.run(command(tiny_run_inputs, ref), capture_output=True, env={
        **os.environ, "PYTHONPATH": os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")])}).returncode == 0

    out = tmp_path / "killed"
    ckpt_dir = out / "checkpoints"
    kills: list[str] = []
    for i in range(KILLS + 1):
        newest_before = max(complete_steps(ckpt_dir), default=0)
        log = tmp_path / f"run{i}.log"
        proc = start(command(tiny_run_inputs, out, *(["--resume", "auto"] if i else [])), log)
        if i < KILLS:
            if i % 2 == 0:       # during a save: as soon as this process's temporary directory exists
                reached = wait_for(lambda: saving(out, proc.pid), proc)
                delay = rng.uniform(0.0, 0.02)
            else:                # during steps: a random moment after this process's first new checkpoint
                reached = wait_for(lambda: max(complete_steps(ckpt_dir), default=0) > newest_before, proc)
                delay = rng.uniform(0.0, 0.15)
            assert reached, f"run {i} ended before its kill:\n{log.read_text()[-3000:]}"
            time.sleep(delay)
            during_save = saving(out, proc.pid)
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
            kills.append("save" if during_save else "step")
        else:
            assert proc.wait(timeout=600) == 0, log.read_text()[-3000:]
        text = log.read_text()
        if i:
            # the resume took the newest complete checkpoint there was, never a temporary directory
            m = RESUMED.search(text)
            if m is None:          # killed before it got that far (its start-up took the whole delay)
                assert i < KILLS and "Traceback" not in text, text[-3000:]
                continue
            path, step = Path(m.group(1)), int(m.group(2))
            assert CKPT.match(path.name) and int(CKPT.match(path.name).group(1)) == step, text[-2000:]
            assert step >= newest_before, (step, newest_before)
    assert len(kills) == KILLS and "save" in kills and "step" in kills, kills
    leftovers = [p.name for d in (out, ckpt_dir) for p in d.iterdir() if ".tmp-" in p.name or ".old-" in p.name]
    assert not leftovers, leftovers
    got, want = load_file(out / "final" / "model.safetensors"), load_file(ref / "final" / "model.safetensors")
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), name
