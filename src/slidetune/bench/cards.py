"""Consumer cards a step can be predicted for from this machine's probes (`plan --terms --card`).

slidetune is for a GPU too small for the training state, and the machines it is measured on are
H100s and H200s. A card here is what the floor needs of a GPU that is not this one: its memory
(the placement it gets), its PCIe link (h2d_s, d2h_s) and its dense BF16 tensor rate (compute_s).
The host's terms (AdamW, DRAM, disk) are this host's: the card is assumed in this machine.

card_probes scales this machine's probes to the card: every compute time by this GPU's probed
GEMM rate (bench.hardware_floor.probe_gemm, the layer's shapes in BF16) over the card's published
dense peak, and the copies' rates replaced by the card's link. A floor, like the rest: the card
at its published peak. (main-horse.github.io/posts/5090-mm-perf measured torch.matmul BF16 at
~224 TFLOP/s on an RTX 5090 at 16384 x 8192 x 1280, above the 209.5 published.)
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Card:
    name: str
    memory_gib: float       # the plan's GPU: --gpu-free-gib this, as --gpu-memory-limit N emulates an N GB card
    pcie_gb_s: float        # each direction, decimal GB/s, a pinned copy's measured rate on its link
    bf16_tflops: float      # dense BF16 tensor TFLOP/s with FP32 accumulate (no sparsity), the vendor's

    @property
    def pcie_gib_s(self) -> float:
        return self.pcie_gb_s * 1e9 / 2**30


# PCIe: 4.0 x16 is 31.5 GB/s of raw link each way, ~25 measured for pinned copies (the H200 VM's
# 5.0 x16, 63 raw, probes ~50: bench.floor_probes.probe_copy), so 5.0 x16 is taken as ~50.
# TFLOP/s: dense "Peak BF16 Tensor TFLOPS with FP32 Accumulate" (the GeForce cards run FP32
# accumulation at half their FP16-accumulate rate; a training GEMM accumulates in FP32):
#   RTX 3090: 71     NVIDIA Ampere GA102 GPU Architecture whitepaper, appendix table (71/142 sparse)
#   RTX 4090: 165.2  NVIDIA Ada GPU Architecture whitepaper, appendix table (165.2/330.4 sparse)
#   RTX 4080: 97.5   NVIDIA Ada GPU Architecture whitepaper, appendix table (97.5/194.9 sparse)
#   RTX 5090: 209.5  NVIDIA RTX Blackwell GPU Architecture whitepaper, appendix table (209.5/419 sparse)
# Memory: the marketed GB, taken as GiB as --gpu-memory-limit takes it (CUDA reports 31.4 GiB of a
# 5090's 32 GB; the fit keeps a safety share of what is given).
CARDS: dict[str, Card] = {c.name: c for c in (
    Card("rtx3090", 24, 25, 71.0),
    Card("rtx4080", 16, 25, 97.5),
    Card("rtx4090", 24, 25, 165.2),
    Card("rtx5090", 32, 50, 209.5),
)}


def card_named(name: str) -> Card:
    """The card of `name` (case and dashes ignored: RTX-4090, rtx4090), or a ValueError naming the known ones."""
    key = name.strip().lower().replace("-", "").replace("_", "").replace(" ", "")
    if key not in CARDS:
        raise ValueError(f"unknown card {name!r}: known cards are {', '.join(CARDS)}")
    return CARDS[key]


def card_probes(comp: dict, copy: dict, gemm: dict, card: Card) -> tuple[dict, dict]:
    """This machine's compute and copy probes (probe_compute's, probe_copy's) as `card` would have
    them, for bench.roofline.floor_terms: every compute time (the *_s keys: layers, head, embedding,
    compute_s) times this GPU's GEMM rate (probe_gemm's gemm_tflops) over the card's dense BF16 peak,
    and the copies at the card's link each way. The host's probes (AdamW, DRAM, disk) are left as
    they are: the same host."""
    if not gemm or not gemm.get("gemm_tflops"):
        raise ValueError("scaling compute to a card needs this GPU's probed GEMM rate (probe_gemm's gemm_tflops)")
    factor = gemm["gemm_tflops"] / card.bf16_tflops
    scaled = {k: v * factor if k.endswith("_s") and isinstance(v, (int, float)) else v for k, v in comp.items()}
    if comp.get("model_tflops_at_floor"):
        scaled["model_tflops_at_floor"] = comp["model_tflops_at_floor"] / factor
    return scaled, {**copy, "h2d_gib_s": card.pcie_gib_s, "d2h_gib_s": card.pcie_gib_s}
