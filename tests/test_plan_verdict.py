"""`slidetune plan` always answers: fits, or does not fit with the options that do, for the machine
it runs on or the one its flags describe (--device cuda --gpu-free-gib --host-gib; --host-gib on the
CPU). Every option it prints is re-run as a command, which must then fit; the disk tier is offered
where it makes a configuration fit (PATH in an option: a directory on a local disk)."""
from __future__ import annotations

import contextlib
import io
import re

import pytest

from slidetune.cli import main

# a described machine: a 24 GiB GPU, 64 GiB of host RAM and a disk with 200 GiB free (whatever this one has)
# the chunked head and no offload given: a GPU configuration that does not fit (the auto settings
# would fuse the head and offload checkpoints, and fit), so that the options are what is tested
GPU_24G = ["--model", "qwen3-8b", "--batch-size", "16", "--seq-len", "1024", "--device", "cuda",
           "--tuning.head_impl", "chunked", "--offload-activations", "off",
           "--gpu-free-gib", "21", "--host-gib", "64", "--disk-free-gib", "200"]


def plan(*args: str) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        code = main(["plan", *args])
    assert code == 0, out.getvalue()
    return out.getvalue()


def verdict(text: str) -> str:
    line = next(l for l in text.splitlines() if l.startswith(("fits", "does not fit")))
    return "fits" if line.startswith("fits") else "does not fit"


def options(text: str) -> list[list[str]]:
    """The flags of each option a refusal prints ("  --flag value ...  -> GPU ... host ...")."""
    return [line.split("  -> ")[0].split() for line in text.splitlines()
            if line.startswith("  --") and "  -> " in line]


def assert_every_option_fits(base: list[str], text: str, disk_dir: str) -> int:
    found = options(text)
    for flags in found:
        flags = [disk_dir if f == "PATH" else f for f in flags]
        again = plan(*base, *flags)
        assert verdict(again) == "fits", (flags, again)
    return len(found)


@pytest.mark.slow
def test_disk_units_chosen_by_auto_are_valid_and_every_option_fits(tmp_path):
    """The case that raised "--tuning.disk_units 37 but only 36 units can go to disk": the suggestions
    re-resolved the disk tier's units for a placement with the head on the GPU."""
    base = GPU_24G + ["--disk-dir", str(tmp_path)]
    text = plan(*base)
    assert verdict(text) == "does not fit" and "disk_units=37" in text
    assert assert_every_option_fits(base, text, str(tmp_path)) >= 3


@pytest.mark.slow
def test_disk_tier_offered_where_it_makes_a_gpu_configuration_fit(tmp_path):
    """Without --disk-dir, host RAM too small (and the GPU too): the disk tier with the GPU's options."""
    text = plan(*GPU_24G)
    assert verdict(text) == "does not fit" and "With a local disk: --disk-dir PATH" in text
    disk_options = [o for o in options(text) if o[:2] == ["--disk-dir", "PATH"]]
    assert disk_options
    assert_every_option_fits(GPU_24G, text, str(tmp_path))


@pytest.mark.parametrize("host_gib, expected", [("64", "fits"), ("26", "does not fit")])
def test_cpu_machine_gets_a_verdict(tmp_path, host_gib, expected):
    """On a CPU (--device cpu, a host of --host-gib): a verdict, and where host RAM is short the disk tier.
    FP32 given: dtype auto resolves by the CPU's bf16 instructions, which CI machines differ in (FP32
    here needs 33.1 GiB of host RAM, 24.7 with the disk tier)."""
    base = ["--model", "qwen3-1.7b", "--device", "cpu", "--dtype", "fp32", "--host-gib", host_gib,
            "--disk-free-gib", "200"]
    text = plan(*base)
    assert verdict(text) == expected
    assert not re.search(r"GPU [\d.]+ GiB", text.split("resolved on")[1].splitlines()[0])   # no GPU figures
    if expected == "does not fit":
        assert re.search(r"With a local disk: --disk-dir PATH \(the disk tier: AdamW moments of \d+ units", text)
        assert verdict(plan(*base, "--disk-dir", str(tmp_path))) == "fits"


def test_a_disk_too_small_for_the_tier_is_the_verdict(tmp_path):
    text = plan(*GPU_24G[:-2], "--disk-free-gib", "20", "--disk-dir", str(tmp_path))
    assert "does not fit: --disk-dir" in text and "has 20.0 GiB free but the disk tier needs" in text
