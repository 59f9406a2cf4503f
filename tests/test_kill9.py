"""Kill -9 anywhere: a run killed at 20 seeded random moments, during steps and during saves,
continues each time with `--resume auto` from its newest complete checkpoint (never from a
temporary directory) and ends with the weights of an uninterrupted run, bit for bit.

One chain of processes: start, kill, resume, kill again... Each training process is forked
from a helper process that has imported slidetune, torch and transformers once (`ZYGOTE`):
importing them costs 4-8 s of CPU per process on 2 cores, which 22 processes cannot afford
here; a forked child is still a separate process, killed with SIGKILL by its pid. The model is
a 2-layer Llama of vocabulary 320 with its own small BPE tokenizer in a HF directory (the
embedded GGUF tokenizer alone takes 20 s to load), saving a checkpoint every step.
"""
from __future__ import annotations

import json
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
    return ["train", "--model", str(model_dir), "--data", str(data),
            "--seq-len", "16", "--batch-size", "2", "--eval-batches", "1", "--max-steps", str(STEPS),
            "--save-every", "1", "--keep-last", "2", "--progress", "false", "--device", "cpu",
            "--output-dir", str(out), *extra]


# Reads [argv, log] lines; forks a child that runs `slidetune <argv>` with stdout and stderr
# line-buffered into `log`; answers the child's pid, then its exit code once it ends.
ZYGOTE = """
import json, os, sys
from slidetune.cli import main
import slidetune.trainer          # noqa: F401 - everything a run imports, imported once
for line in sys.stdin:
    argv, log = json.loads(line)
    pid = os.fork()
    if pid == 0:
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        sys.stdout.reconfigure(line_buffering=True)
        sys.stderr.reconfigure(line_buffering=True)
        code = 1
        try:
            code = main(argv)
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    print(pid, flush=True)
    print(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]), flush=True)
"""


class Zygote:
    """The helper process that forks each training run (see the module docstring)."""

    def __init__(self):
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")])}
        env.pop("SLIDETUNE_INJECT_FAULT", None)
        self.proc = subprocess.Popen([sys.executable, "-c", ZYGOTE], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, env=env)

    def start(self, argv: list[str], log: Path) -> int:
        """Fork a run of `slidetune argv`; its pid."""
        self.proc.stdin.write(json.dumps([argv, str(log)]) + "\n")
        self.proc.stdin.flush()
        return int(self.proc.stdout.readline())

    def exit_code(self) -> int:
        """Wait for the run started last; its exit code (-9 when killed)."""
        return int(self.proc.stdout.readline())

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def alive(pid: int) -> bool:
    """Whether `pid` runs (the zygote reaps it only after its exit is read, so check its state too)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


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


def wait_for(cond, pid: int, timeout_s: float = 180.0) -> bool:
    """Poll `cond` every 2 ms; False if the process ended first."""
    t0 = time.monotonic()
    while not cond():
        if not alive(pid):
            return False
        assert time.monotonic() - t0 < timeout_s, "the training process made no progress"
        time.sleep(0.002)
    return True


@pytest.mark.slow
def test_kill_9_at_20_random_moments_then_resume_auto_ends_with_the_uninterrupted_weights(tiny_run_inputs, tmp_path):
    rng = random.Random(22)
    zygote = Zygote()
    ref = tmp_path / "uninterrupted"
    zygote.start(command(tiny_run_inputs, ref), tmp_path / "ref.log")
    assert zygote.exit_code() == 0, (tmp_path / "ref.log").read_text()[-3000:]

    out = tmp_path / "killed"
    ckpt_dir = out / "checkpoints"
    kills: list[str] = []
    resumes = 0
    for i in range(KILLS + 1):
        newest_before = max(complete_steps(ckpt_dir), default=0)
        log = tmp_path / f"run{i}.log"
        pid = zygote.start(command(tiny_run_inputs, out, *(["--resume", "auto"] if i else [])), log)
        if i < KILLS:
            if i % 2 == 0:       # during a save: as soon as this process's temporary directory exists
                reached = wait_for(lambda: saving(out, pid), pid)
                delay = rng.uniform(0.0, 0.004)     # a tiny model's save lasts a few ms
            else:                # during steps: a random moment after this process's first new checkpoint
                reached = wait_for(lambda: max(complete_steps(ckpt_dir), default=0) > newest_before, pid)
                delay = rng.uniform(0.0, 0.15)
            assert reached, f"run {i} ended before its kill:\n{log.read_text()[-3000:]}"
            time.sleep(delay)
            os.kill(pid, signal.SIGKILL)
            assert zygote.exit_code() == -signal.SIGKILL
            # Classified after the kill: a killed process's temporary directory stays until the next
            # run cleans it, so it is there exactly when the kill landed inside a save.
            during_save = saving(out, pid)
            kills.append("save" if during_save else "step")
        else:
            assert zygote.exit_code() == 0, log.read_text()[-3000:]
        text = log.read_text()
        assert "Traceback" not in text, text[-3000:]
        if i:
            # the resume took the newest complete checkpoint there was, never a temporary directory
            resumes += 1
            m = RESUMED.search(text)
            if m is None:          # killed during the first save: nothing complete to resume yet
                assert newest_before == 0 and "--resume auto: no complete checkpoint" in text, text[-3000:]
                continue
            path, step = Path(m.group(1)), int(m.group(2))
            assert CKPT.match(path.name) and int(CKPT.match(path.name).group(1)) == step, text[-2000:]
            assert step >= newest_before, (step, newest_before)
    zygote.close()
    # Half the kills aim at a save; on a loaded machine a save can end before the signal lands,
    # so a quarter is what the schedule must reach for the test to have exercised both cases.
    assert resumes == KILLS and kills.count("save") >= KILLS // 4 and "step" in kills, kills
    leftovers = [p.name for d in (out, ckpt_dir) for p in d.iterdir() if ".tmp-" in p.name or ".old-" in p.name]
    assert not leftovers, leftovers
    got, want = load_file(out / "final" / "model.safetensors"), load_file(ref / "final" / "model.safetensors")
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), name
