"""--dtype auto: bf16 where the device computes it natively, fp32 elsewhere (device.resolve_dtype).

The CPU's features come from /proc/cpuinfo; these tests hand the detection fake cpuinfo files of
the two kinds of CPU (an AVX2-only one, as a 2-core AMD EPYC of the cloud, and one with AVX512-BF16
or AMX-BF16) and check what a run resolves to on each.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from slidetune import device as device_mod
from slidetune.device import cpu_bf16, cpu_flags, resolve_dtype
from slidetune.engine.config import RuntimeConfig

from slidetune.data.corpus import builtin_corpus

from test_train_e2e import BASE, run_cli

AVX2_ONLY = ("fpu vme sse sse2 ssse3 sse4_1 sse4_2 avx f16c fma avx2 bmi1 bmi2 sha_ni")
WITH_AVX512_BF16 = AVX2_ONLY + " avx512f avx512dq avx512bw avx512vl avx512_vnni avx512_bf16"
WITH_AMX = WITH_AVX512_BF16 + " amx_bf16 amx_tile amx_int8"


def fake_cpuinfo(directory: Path, flags: str, cpus: int = 2) -> Path:
    """A /proc/cpuinfo as Linux writes it on x86: one block per logical CPU."""
    block = ("processor\t: {i}\nvendor_id\t: AuthenticAMD\nmodel name\t: AMD EPYC\ncpu cores\t: {n}\n"
             "flags\t\t: {flags}\nbugs\t\t: sysret_ss_attrs\n\n")
    path = directory / "cpuinfo"
    path.write_text("".join(block.format(i=i, n=cpus, flags=flags) for i in range(cpus)))
    return path


@pytest.mark.parametrize("flags, native", [(AVX2_ONLY, False), (WITH_AVX512_BF16, True), (WITH_AMX, True)])
def test_cpu_bf16_is_detected_from_the_cpuinfo_flags(tmp_path, monkeypatch, flags, native):
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    info = fake_cpuinfo(tmp_path, flags)
    assert cpu_flags(info) == set(flags.split())
    assert cpu_bf16(cpu_flags(info))[0] is native
    dtype, why = resolve_dtype("auto", "cpu", cpuinfo=info)
    assert dtype == ("bf16" if native else "fp32")
    assert ("natively" in why) is native and ("no bf16 instructions" in why) is (not native)


def test_onednn_isa_cap_below_bf16_resolves_fp32(tmp_path, monkeypatch):
    """ONEDNN_MAX_CPU_ISA=AVX2 keeps oneDNN off the bf16 instructions the CPU has: as on an AVX2 CPU."""
    info = fake_cpuinfo(tmp_path, WITH_AMX)
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    assert resolve_dtype("auto", "cpu", cpuinfo=info) == (
        "fp32", "ONEDNN_MAX_CPU_ISA=AVX2 keeps oneDNN off the CPU's bf16 instructions (amx_bf16, avx512_bf16)")
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_AMX")
    assert resolve_dtype("auto", "cpu", cpuinfo=info)[0] == "bf16"


def test_explicit_dtype_is_kept_and_auto_is_the_default(tmp_path):
    info = fake_cpuinfo(tmp_path, AVX2_ONLY)
    assert resolve_dtype("bf16", "cpu", cpuinfo=info) == ("bf16", "as asked (--dtype)")
    assert RuntimeConfig().dtype == "auto"
    with pytest.raises(ValueError, match="dtype must be auto, bf16, fp32 or fp16"):
        RuntimeConfig(dtype="bfloat16")


def test_training_in_fp16_is_refused_naming_what_to_use():
    """No loss scaling: a run in FP16 is refused before anything loads, from the flags, a YAML or
    Python alike (TrainConfig); the runtime itself still takes it (the bench measures FP16)."""
    from slidetune.config import TrainConfig
    with pytest.raises(ValueError, match="--dtype fp16 would train without loss scaling.*--dtype bf16.*--dtype fp32"):
        TrainConfig(runtime={"dtype": "fp16"})
    assert RuntimeConfig(dtype="fp16").dtype == "fp16"


@pytest.mark.parametrize("flags, expected", [(AVX2_ONLY, "fp32"), (WITH_AVX512_BF16, "bf16")])
def test_train_resolves_auto_for_the_cpu_it_runs_on(tmp_path, monkeypatch, flags, expected):
    """`train` with the default dtype on a fake CPU: the run says which dtype and why, config.json and
    summary.json record it, and the engine computes in it."""
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    monkeypatch.setattr(device_mod, "CPUINFO", fake_cpuinfo(tmp_path, flags))
    data = tmp_path / "small.jsonl"
    data.write_text("".join(json.dumps({"text": doc}) + "\n" for doc in builtin_corpus()[:20]))
    out = tmp_path / "run"
    code, stdout, err = run_cli(*BASE, "--data", str(data), "--max-steps", "1", "--output-dir", str(out))
    assert code == 0, err
    assert f", {expected} (--dtype auto: " in stdout
    assert json.loads((out / "config.json").read_text())["runtime"]["dtype"] == expected
    assert json.loads((out / "summary.json").read_text())["dtype"] == expected
