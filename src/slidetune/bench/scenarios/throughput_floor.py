"""The floor a `bench throughput` run is held to: the floor probe's terms for the placement and
recipe the run resolved to (bench.roofline.floor_terms), and the hardware floor beside it (the
step's FLOPs at the GEMM and SDPA rates probed on this GPU); the floors' keys in throughput.json."""
from __future__ import annotations

from ...engine.tiers import TIERS
from ..floor_probes import compute_of_run
from ..hardware_floor import hardware_compute
from ..roofline import floor_terms, plan_of_runtime


def _floor_key(model: str, batch: int, seq: int, layer: str, state: tuple[str, str] = ("fp32", "fp32")) -> str:
    """floors' key: the workload, /lean where the floor timed the lean layer, and the host state
    format where its AdamW probe kept a compact one ("/master-bf16-moments-8bit")."""
    return (f"{model}/b{batch}/s{seq}" + ("/lean" if layer == "lean" else "")
            + ("" if state == ("fp32", "fp32") else f"/master-{state[0]}-moments-{state[1]}"))


def _state_of(system: str, r: dict) -> tuple[str, str]:
    """(master, moments) a run kept its host state in (slide's runtime; FP32 for the others)."""
    rt = (r.get("runtime") or {}) if system == "slide" else {}
    return str(rt.get("master", "fp32")), str(rt.get("moments", "fp32"))


def _layer_ran(system: str, r: dict) -> str:
    """The decoder layer a run ran, for its floor's compute probe: "lean" where slide resolved
    lean_layer on, else HF's ("hf": the baselines, and a run that ended before it resolved)."""
    rt = r.get("runtime") or {}
    return "lean" if system == "slide" and rt.get("lean_layer") == "on" else "hf"


def _grad_bytes(runtime: dict | None, default: int) -> int:
    """Bytes per parameter of a slide run's gradient slots, what its all-reduce moves: FP32 slots
    (grad_slot_dtype=fp32) or FP32 compute 4, else the compute dtype's 2; `default` without a runtime."""
    if runtime:
        return 4 if runtime.get("grad_slot_dtype") == "fp32" or runtime.get("dtype") == "fp32" else 2
    return default


def recomputed_layers_of(system: str, r: dict, num_layers: int) -> set[int]:
    """The decoder layers a run recomputed in its backward. slide and gpu-ckpt: as their runtime
    resolves it (RuntimeConfig.recomputed_layers; the spec's where the run recorded none). The
    baselines: their spec's `recompute` (HF gradient checkpointing of every decoder layer, or of
    none); a result without one (a worker that failed before writing its spec) as this scenario runs
    them, FSDP2Spec's default."""
    from ...engine.config import RuntimeConfig
    from ..baselines.fsdp2 import FSDP2Spec
    spec = r.get("spec") or {}
    if system in ("slide", "gpu-ckpt"):
        rt = r.get("runtime") or spec.get("runtime") or {}
        mode = rt.get("mode") or ("slide" if system == "slide" else "ckpt")
        return RuntimeConfig(mode=mode, recompute=str(rt.get("recompute", "all"))).recomputed_layers(num_layers)
    return set(range(num_layers)) if spec.get("recompute", FSDP2Spec.recompute) else set()


def _hardware_floor(system: str, r: dict, fl: dict, recipe: dict, collective: dict | None, ranks: int
                    ) -> tuple[float | None, str | None, dict]:
    """(hardware floor seconds, its largest term, the terms) of one run: _floor's terms with the
    compute probe replaced by the step's FLOPs at the probed GEMM and SDPA rates
    (bench.hardware_floor.hardware_compute, the run's own recomputation), its GPU AdamW and all-reduce
    kept. (None, None, {}) without the probes: a CPU floor (partial) or a floor recorded before them."""
    hw = fl.get("hardware")
    if not hw or fl.get("partial") or not fl.get("compute"):
        return None, None, {}
    rc = recomputed_layers_of(system, r, len(hw["flops"]["layer_matmul"]))
    # the GPU's rates in place of any layer's timing (the lean layer's too: compute_of_run leaves it)
    probed = {k: v for k, v in fl["compute"].items() if not k.startswith("lean_layer_")}
    comp = {**probed, **hardware_compute(hw, rc)}
    if system == "slide" and r.get("runtime"):
        return _floor(system, r, {**fl, "compute": comp}, recipe, collective, ranks)
    # the probe's own placement (every unit on the host): its compute term, replaced
    terms = {k: v for k, v in (fl.get("terms") or {}).items() if v is not None}
    terms["compute_s"] = comp["compute_s"]
    bound = max(terms, key=terms.get)
    return terms[bound], bound, terms


def _floor(system: str, r: dict, fl: dict, recipe: dict, collective: dict | None, ranks: int
           ) -> tuple[float | None, str | None, dict]:
    """(floor seconds, its largest term, the terms) of one run. A slide run: the floor of the placement
    it resolved to (units updated on the GPU cost the host neither AdamW nor copies; the probe's floor
    assumes every unit on the host), on `ranks` data-parallel ranks with the all-reduce term from
    `collective` (bench.roofline.floor_terms). Without CUDA the floor is partial (the AdamW term):
    the all-reduce term joins it, at the units' sizes the probe recorded."""
    floor_s, bound, terms = fl.get("floor_s"), fl.get("bound_by"), dict(fl.get("terms") or {})
    rt = r.get("runtime")
    if system == "slide" and rt and not fl.get("partial"):
        comp = compute_of_run(fl["compute"], rt)          # the layer the run ran: HF's or the lean one
        plan = plan_of_runtime(comp, rt, clipped=bool(recipe["max_grad_norm"]))
        terms = floor_terms(comp, fl["copy"], fl["adamw"], plan, device_adamw=fl.get("device_adamw"),
                            disk=TIERS.with_files.probe_of(fl), split_sweep=rt.get("clip_sweep") != "whole",
                            collective=collective, ranks=ranks,
                            # a run recorded before dp_weights existed uploaded from every rank
                            grad_bytes=_grad_bytes(rt, 2), dp_weights=rt.get("dp_weights", "upload"))
    elif system == "slide" and collective and collective.get("sizes_from", {}).get("unit_numels"):
        from ..collective import allreduce_term
        terms = {k: v for k, v in terms.items() if v is not None}
        terms["allreduce_s"] = allreduce_term(collective["sizes_from"]["unit_numels"], collective,
                                              _grad_bytes(rt, collective["sizes_from"].get("grad_bytes", 4)))
    else:
        return floor_s, bound, terms
    known = {k: v for k, v in terms.items() if v is not None}
    bound = max(known, key=known.get)
    return known[bound], bound, terms
