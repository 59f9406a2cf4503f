"""`slidetune plan --terms --card NAME` (bench/cards.py): this machine's probes scaled to a consumer
card, the flag's parsing, and what a machine without a GPU says."""
from __future__ import annotations

import contextlib
import io

import pytest

from slidetune.bench.cards import CARDS, card_named, card_probes
from slidetune.bench.roofline import floor_terms
from slidetune.cli import build_parser, main

# an H200's probes of a Qwen3-8B-like step (numbers of the shape probe_compute, probe_copy,
# probe_adamw and probe_gemm return; the arithmetic is what is tested)
COMP = {"layer_forward_s": 0.02, "layer_recompute_backward_s": 0.06, "head_s": 0.05, "embed_s": 0.01,
        "compute_s": 36 * 0.08 + 0.06, "model_tflops_at_floor": 500.0, "params": 8_190_000_000,
        "layer_params": 195_000_000, "vocab_params": 1_240_000_000, "num_layers": 36, "embed_params": 620_000_000}
COPY = {"h2d_gib_s": 50e9 / 2**30, "d2h_gib_s": 48e9 / 2**30}
ADAMW = {"adamw_params_per_s": 4.0e9}
GEMM = {"gemm_tflops": 660.0}


def test_a_card_scales_compute_by_the_gemm_rates_and_copies_by_the_links():
    card = CARDS["rtx4090"]
    comp, copy = card_probes(COMP, COPY, GEMM, card)
    factor = 660.0 / 165.2
    assert comp["compute_s"] == pytest.approx(COMP["compute_s"] * factor)
    assert comp["layer_recompute_backward_s"] == pytest.approx(0.06 * factor)
    assert comp["model_tflops_at_floor"] == pytest.approx(500.0 / factor)
    assert comp["params"] == COMP["params"] and comp["num_layers"] == 36
    assert copy["h2d_gib_s"] == copy["d2h_gib_s"] == pytest.approx(25e9 / 2**30)
    here = floor_terms(COMP, COPY, ADAMW)
    there = floor_terms(comp, copy, ADAMW)
    assert there["compute_s"] == pytest.approx(here["compute_s"] * factor)
    assert there["h2d_s"] == pytest.approx(here["h2d_s"] * 50 / 25)
    assert there["d2h_s"] == pytest.approx(here["d2h_s"] * 48 / 25)
    assert there["adamw_s"] == here["adamw_s"]                  # the same host


def test_a_pcie5_card_keeps_an_h200s_link():
    _, copy = card_probes(COMP, COPY, GEMM, CARDS["rtx5090"])
    assert copy["h2d_gib_s"] == pytest.approx(COPY["h2d_gib_s"])


def test_scaling_compute_needs_the_gemm_probe():
    with pytest.raises(ValueError, match="GEMM rate"):
        card_probes(COMP, COPY, {}, CARDS["rtx3090"])


def test_the_flag_takes_a_known_card_in_any_spelling_and_names_the_known_ones_otherwise():
    parser = build_parser()
    assert parser.parse_args(["plan", "--card", "RTX-4090"]).card is CARDS["rtx4090"]
    assert card_named("rtx 5090") is CARDS["rtx5090"]
    err = io.StringIO()
    with contextlib.redirect_stderr(err), pytest.raises(SystemExit):
        parser.parse_args(["plan", "--card", "rtx4070"])
    assert "unknown card 'rtx4070'" in err.getvalue()
    assert all(name in err.getvalue() for name in ("rtx3090", "rtx4080", "rtx4090", "rtx5090"))


def _plan(*args: str) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        assert main(["plan", *args]) == 0, out.getvalue()
    return out.getvalue()


@pytest.mark.parametrize("card, gib", [("rtx4080", 16), ("rtx5090", 32)])
def test_the_plan_is_the_cards_placement(card, gib):
    text = _plan("--model", "qwen3-8b", "--batch-size", "8", "--seq-len", "1024", "--host-gib", "128",
                 "--no-limits", "--card", card)
    assert f"a GPU with {gib:.1f} GiB free" in text


def test_card_and_gpu_free_gib_are_refused_together(capsys):
    assert main(["plan", "--model", "qwen3-8b", "--card", "rtx4090", "--gpu-free-gib", "20"]) != 0
    assert "not both" in capsys.readouterr().err


def test_without_a_gpu_the_prediction_says_what_it_cannot_scale(capsys):
    from slidetune.cli import _print_card_terms
    from slidetune.config import config_from_args
    cfg = config_from_args(build_parser().parse_args(["plan", "--model", "qwen3-8b"]))
    _print_card_terms(cfg, {"partial": True}, None, CARDS["rtx4090"], {"adamw_s": 1.5})
    out = capsys.readouterr().out
    assert "rtx4090" in out and "compute_s, h2d_s and d2h_s cannot be predicted here" in out
