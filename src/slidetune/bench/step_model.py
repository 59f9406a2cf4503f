"""The predicted step of a placement: the floor's terms (bench.roofline.floor_terms, with the
offloaded checkpoints' traffic: add_checkpoint_traffic) priced from rates, so that the auto search
(engine/fit/search.py) can choose between placements that fit by the time each is predicted to
take, on a machine without a GPU too.

    model = StepModel(split, batch_size=64, seq_len=1024, rates=NOMINAL_RATES)
    model.predict(rt, plan)      # StepPrediction: seconds, the bound, every term

The rates: the ones `slidetune plan --terms` probes on this machine (rates_from_floor), else
NOMINAL_RATES, an H200 host's probes named below, or a card's (rates_for_card: its link and dense
BF16 rate in place of the GPU's). The GPU's compute: the layer timed at the workload where the
probe timed it (both layer kinds), else the step's FLOPs (telemetry.flops.step_flops, every layer
recomputed) at the GEMM and SDPA rates (bench.hardware_floor.hardware_compute) times the measured
time of the layer kind over those rates (LAYER_OVER_HARDWARE). A prediction is a floor with the
layer's measured overhead in it: the largest term, nothing for what fails to overlap.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from ..engine.config import RuntimeConfig
from ..engine.placement import PlacementPlan
from ..engine.tiers import TIERS
from ..models.units import SplitModel

# One Qwen3-8B decoder layer's recompute + backward at 64 x 1024 tokens on the H200, compiled,
# over the same FLOPs at the GEMM and SDPA rates probed at its shapes (110.4 ms):
# HF's layer 121.9 ms, the lean layer in row tiles 135.4 ms (benchmarks/results/lean_layer/row_tiles_h200/,
# NOTES.md "Lean layer"; at 16 x 1024 the lean layer was 1.11x HF's too, 34.0 vs 30.5 ms). The
# head and the embedding stay at the hardware's rates.
LAYER_OVER_HARDWARE = {"off": 121.9 / 110.4, "on": 135.4 / 110.4}

# The nominal rates where nothing was probed: the floor probe of the 24 GiB Qwen3-8B b64 x 1024
# row on the H200 host (16-core Xeon VM, PCIe Gen5; benchmarks/results/throughput/
# slideformer_shapes_h200/g24_qwen3_b16_b32_b64/throughput.json, floors "qwen3-8b/b64/s1024/lean",
# 2026-11-26): BF16 GEMM on the layer's shapes, pinned copies, the native host AdamW on 16 threads
# (FP32 state), its DRAM probe, the GPU's AdamW; SDPA by length from NOMINAL_SDPA_BY_SEQ (the
# row's own probe, 474 / 303 at 64 x 1024, is kept as the rates' fixed pair).
NOMINAL_SOURCE = ("nominal: the H200 host's probes of 2026-11-26 (benchmarks/results/throughput/"
                  "slideformer_shapes_h200/g24_qwen3_b16_b32_b64/)")
# SDPA's own choice in HF's layout on the same H200 (cuDNN's fused attention), causal GQA at Qwen3-8B's
# heads, TFLOP/s forward / backward by sequence length (benchmarks/results/attention/, NOTES.md
# "Attention kernels", 2026-11-29): a sequence takes the row of the longest length not above it.
NOMINAL_SDPA_BY_SEQ = ((1024, 427.0, 291.0), (4096, 586.0, 471.0), (16384, 583.0, 523.0), (65536, 605.0, 544.0),
                       (131072, 561.0, 538.0))
NOMINAL_ADAMW = {"adamw_bf16_grad_params_per_s": 4.354e9, "adamw_fp32_grad_params_per_s": 4.149e9,
                 "adamw_weights_pass_params_per_s": 6.601e9, "adamw_moments_pass_params_per_s": 6.803e9,
                 "adamw_weights_copy_pass_params_per_s": 6.950e9, "dram_gib_s": 105.8,
                 "master": "fp32", "moments": "fp32"}


@dataclass(frozen=True)
class StepRates:
    """What a step's terms are priced at. copy, adamw, disk: the probes' dicts (probe_copy,
    probe_adamw, probe_disk); compute: probe_compute's (both layer kinds timed) at
    `compute_workload` (batch, seq), used in place of the FLOPs for that workload only."""
    gemm_forward_tflops: float
    gemm_backward_tflops: float
    sdpa_forward_tflops: float
    sdpa_backward_tflops: float
    copy: dict
    adamw: dict
    device_adamw_params_per_s: float
    layer_over_hardware: dict = field(default_factory=lambda: dict(LAYER_OVER_HARDWARE))
    compute: dict | None = None
    compute_workload: tuple[int, int] | None = None
    disk: dict | None = None
    source: str = NOMINAL_SOURCE
    sdpa_by_seq: tuple | None = None    # ((seq, forward, backward), ...): SDPA by length, where not probed
    label: str = "nominal"              # source in a word or two, for one line of `plan`

    def sdpa_at(self, seq_len: int) -> tuple[float, float]:
        """SDPA's (forward, backward) TFLOP/s at `seq_len`: the table's row of the longest length not
        above it (its first below them all), else the rates as probed."""
        if not self.sdpa_by_seq:
            return self.sdpa_forward_tflops, self.sdpa_backward_tflops
        row = max((r for r in self.sdpa_by_seq if r[0] <= seq_len), default=self.sdpa_by_seq[0], key=lambda r: r[0])
        return row[1], row[2]


NOMINAL_RATES = StepRates(gemm_forward_tflops=707.5, gemm_backward_tflops=705.5, sdpa_forward_tflops=474.0,
                          sdpa_backward_tflops=303.1, copy={"h2d_gib_s": 51.2, "d2h_gib_s": 51.5},
                          adamw=NOMINAL_ADAMW, device_adamw_params_per_s=8.14e10, sdpa_by_seq=NOMINAL_SDPA_BY_SEQ)


def rates_from_floor(fl: dict, base: StepRates = NOMINAL_RATES) -> StepRates:
    """The rates of a floor probe (bench.scenarios.roofline.measure_floor's result): each one this
    machine probed, the rest `base`'s. A probe without a GPU (partial) gave the host's AdamW and
    DRAM (and the disk) only."""
    if fl.get("status") != "ok":
        return base
    adamw = {**fl["adamw"]} if fl.get("adamw") else base.adamw
    if fl.get("partial"):
        return dataclasses.replace(base, adamw=adamw, disk=TIERS.with_files.probe_of(fl),
                                   label="host probed here, GPU " + base.label,
                                   source="probed here: the host's AdamW and DRAM (no GPU here); GPU and PCIe "
                                          + base.source)
    hw = fl.get("hardware") or {}
    spec = fl.get("spec") or {}
    workload = (spec["batch_size"], spec["seq_len"]) if "batch_size" in spec and "seq_len" in spec else None
    return StepRates(
        gemm_forward_tflops=hw.get("gemm_forward_tflops", base.gemm_forward_tflops),
        gemm_backward_tflops=hw.get("gemm_backward_tflops", base.gemm_backward_tflops),
        sdpa_forward_tflops=hw.get("sdpa_forward_tflops", base.sdpa_forward_tflops),
        sdpa_backward_tflops=hw.get("sdpa_backward_tflops", base.sdpa_backward_tflops),
        copy=fl.get("copy") or base.copy, adamw=adamw,
        device_adamw_params_per_s=(fl.get("device_adamw") or {}).get("device_adamw_params_per_s",
                                                                     base.device_adamw_params_per_s),
        layer_over_hardware=base.layer_over_hardware, compute=fl.get("compute"), compute_workload=workload,
        sdpa_by_seq=None if "sdpa_forward_tflops" in hw else base.sdpa_by_seq,
        disk=TIERS.with_files.probe_of(fl), label="probed here",
        source="probed here (the layers timed at this workload, copies, AdamW, DRAM, GPU AdamW)")


def rates_for_card(card, base: StepRates = NOMINAL_RATES) -> StepRates:
    """`base` as bench/cards.py's card would have it: the GPU's rates (and a probed compute) scaled by
    the card's dense BF16 peak over base's GEMM rate, the copies at the card's link; the host's as
    they are (the card in this machine)."""
    gemm = (base.gemm_forward_tflops + base.gemm_backward_tflops) / 2
    factor = card.bf16_tflops / gemm
    compute = ({k: v / factor if k.endswith("_s") and isinstance(v, (int, float)) else v
                for k, v in base.compute.items()} if base.compute else None)
    return dataclasses.replace(
        base, gemm_forward_tflops=base.gemm_forward_tflops * factor,
        gemm_backward_tflops=base.gemm_backward_tflops * factor,
        sdpa_forward_tflops=base.sdpa_forward_tflops * factor, sdpa_backward_tflops=base.sdpa_backward_tflops * factor,
        sdpa_by_seq=tuple((n, f * factor, b * factor) for n, f, b in base.sdpa_by_seq) if base.sdpa_by_seq else None,
        copy={**base.copy, "h2d_gib_s": card.pcie_gib_s, "d2h_gib_s": card.pcie_gib_s}, compute=compute,
        label=f"{card.name}'s link and BF16 rate over {base.label}",
        source=f"{card.name} (its link and dense BF16 rate, bench/cards.py) over {base.source}")


@dataclass(frozen=True)
class StepPrediction:
    seconds: float          # the largest term
    bound: str              # its name
    terms: dict             # every term, seconds (floor_terms' names)


class StepModel:
    """The predicted step of any placement of one workload (`split`, batch_size x seq_len, grad_accum
    micro-batches, ranks_per_host data-parallel ranks) at `rates`; the compute of each layer kind is
    priced once."""

    def __init__(self, split: SplitModel, *, batch_size: int, seq_len: int, grad_accum: int = 1,
                 ranks_per_host: int = 1, rates: StepRates = NOMINAL_RATES):
        self.split, self.batch_size, self.seq_len = split, batch_size, seq_len
        self.grad_accum, self.ranks, self.rates = max(1, grad_accum), max(1, ranks_per_host), rates
        self._compute: dict[str, dict] = {}

    def predict(self, rt: RuntimeConfig, plan: PlacementPlan) -> StepPrediction:
        """The step of `rt` (its lean_layer, transfer and clip settings resolved) placed as `plan`."""
        from ..engine.slide.layer_runner import resolve_lean_layer
        from .roofline import add_checkpoint_traffic, floor_terms
        r = self.rates
        adamw = self._adamw(rt)
        terms = floor_terms(self.compute(resolve_lean_layer(self.split, rt)), r.copy, adamw, plan,
                            device_adamw={"device_adamw_params_per_s": r.device_adamw_params_per_s},
                            disk=r.disk, split_sweep=rt.clip.clip_sweep != "whole", ranks=self.ranks)
        terms = add_checkpoint_traffic(terms, self.offloaded_checkpoint_bytes(rt, plan), r.copy, adamw)
        bound = max(terms, key=terms.get)
        return StepPrediction(terms[bound], bound, terms)

    def offloaded_checkpoint_bytes(self, rt: RuntimeConfig, plan: PlacementPlan) -> int:
        """A step's offloaded layer-input checkpoints: the layers below the last gpu_checkpoints,
        [grad_accum * B, S, d] each in the compute dtype (engine.fit's estimate counts the same)."""
        import torch
        b = torch.empty((), dtype=rt.torch_dtype).element_size()
        d = int(self.split.config.hidden_size)
        return (plan.num_layers - plan.gpu_checkpoints) * self.grad_accum * self.batch_size * self.seq_len * d * b

    def compute(self, layer: str) -> dict:
        """probe_compute's keys for the layer kind ("off": HF's, "on": the lean one), a whole step."""
        if layer not in self._compute:
            self._compute[layer] = self._priced(layer)
        return self._compute[layer]

    def _priced(self, layer: str) -> dict:
        r = self.rates
        L = self.split.num_layers
        if r.compute is not None and r.compute_workload == (self.batch_size, self.seq_len):
            from .floor_probes import compute_of_run
            comp = compute_of_run(r.compute, {"lean_layer": layer})
            # a probe of one layer kind (probe_compute's layer_probed) prices the other by their ratio
            probed = "on" if r.compute.get("layer_probed") == "lean" else "off"
            if layer == "on" and probed == "off" and "lean_layer_recompute_backward_s" not in r.compute:
                comp = _scaled_layers(comp, L, r.layer_over_hardware["on"] / r.layer_over_hardware["off"])
            elif layer == "off" and probed == "on":
                comp = _scaled_layers(comp, L, r.layer_over_hardware["off"] / r.layer_over_hardware["on"])
            # the probe timed one micro-batch; a step runs grad_accum of them through every layer
            return {k: v * self.grad_accum if k.endswith("_s") and isinstance(v, (int, float)) else v
                    for k, v in comp.items()}
        from ..telemetry.flops import step_flops
        from .hardware_floor import hardware_compute
        sdpa_forward, sdpa_backward = r.sdpa_at(self.seq_len)
        hw = {"gemm_forward_tflops": r.gemm_forward_tflops, "gemm_backward_tflops": r.gemm_backward_tflops,
              "sdpa_forward_tflops": sdpa_forward, "sdpa_backward_tflops": sdpa_backward,
              "flops": step_flops(self.split, self.grad_accum * self.batch_size, self.seq_len).as_dict()}
        comp = {**hardware_compute(hw, range(L)), "num_layers": L}
        return _scaled_layers(comp, L, r.layer_over_hardware[layer])

    def _adamw(self, rt: RuntimeConfig) -> dict:
        """The AdamW rates with the gradients' dtype the run downloads (grad_download: compute, where
        the native kernel widens BF16; fp32)."""
        a = dict(self.rates.adamw)
        bf16 = rt.transfer.grad_download == "compute" and "adamw_bf16_grad_params_per_s" in a
        a["grad_dtype"] = "bf16" if bf16 else "fp32"
        a["adamw_params_per_s"] = a["adamw_bf16_grad_params_per_s"] if bf16 else a["adamw_fp32_grad_params_per_s"]
        return a


def _scaled_layers(comp: dict, num_layers: int, factor: float) -> dict:
    """probe_compute's keys with each decoder layer's forward and recompute + backward `factor` x
    (compute_s with them; the head and the embedding as they are)."""
    fwd, rb = comp["layer_forward_s"] * factor, comp["layer_recompute_backward_s"] * factor
    layers = num_layers * (comp["layer_forward_s"] + comp["layer_recompute_backward_s"])
    return {**comp, "layer_forward_s": fwd, "layer_recompute_backward_s": rb,
            "compute_s": comp["compute_s"] - layers + num_layers * (fwd + rb)}
