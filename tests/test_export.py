"""`final/` as a model repository holds it (issue 48, checkpoint/export.py): a run on a source
directory with its own generation_config.json and a chat template given for training ships the
generation config byte for byte, the template with the tokenizer (AutoTokenizer renders the chat as
training did), a model card naming the data and the recipe, and no pickle or trainer state."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from slidetune.checkpoint import CardFacts, model_card
from slidetune.data.chat_template import load_chat_template
from test_hub_ids import TRAIN, save_tiny_model
from test_train_errors import run_cli

GENERATION = {"do_sample": True, "temperature": 0.6, "top_p": 0.9, "eos_token_id": [2, 7], "bos_token_id": 1,
              "transformers_version": "5.17.0"}
CHAT = [{"role": "user", "content": "Name a quiet river."}, {"role": "assistant", "content": "The slow one."}]


@pytest.fixture(autouse=True)
def offline(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def test_final_is_a_model_repository(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    model = tmp_path / "model"
    save_tiny_model(model)
    generation = (json.dumps(GENERATION, indent=3) + "\n").encode()      # its own formatting: kept byte for byte
    (model / "generation_config.json").write_bytes(generation)
    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps({"messages": CHAT}) + "\n" for _ in range(12)))
    out = tmp_path / "run"
    code, stdout, err = run_cli("--model", str(model), "--data", str(data), *TRAIN, "--output-dir", str(out),
                                "--chat-template", "qwen3", "--heldout-fraction", "0", "--seq-len", "160")
    assert code == 0, (stdout[-2000:], err[-3000:])
    final = out / "final"
    assert (final / "generation_config.json").read_bytes() == generation
    files = {p.relative_to(final).as_posix() for p in final.rglob("*") if p.is_file()}
    assert not any(f.startswith("trainer_state/") or f.endswith((".pt", ".pkl", ".bin")) for f in files), files
    assert {"config.json", "model.safetensors", "README.md", "MANIFEST.json", "COMPLETE"} <= files
    tok = AutoTokenizer.from_pretrained(str(final))
    template = load_chat_template("qwen3")
    assert tok.chat_template == template
    assert tok.apply_chat_template(CHAT, tokenize=False) == AutoTokenizer.from_pretrained(str(model)).apply_chat_template(
        CHAT, tokenize=False, chat_template=template)
    AutoModelForCausalLM.from_pretrained(str(final))                   # loads as it is
    card = (final / "README.md").read_text()
    assert str(data) in card and "12 training sequences" in card
    assert "| max_steps | `2` |" in card and "| data.chat_template | `qwen3` |" in card
    assert f"`{model}`" in card and "slidetune" in card
    # the resumable checkpoint keeps its trainer state
    (ckpt,) = (out / "checkpoints").glob("checkpoint-*")
    assert (ckpt / "trainer_state" / "rng.pt").exists()


def export_source(source: Path, final: Path, save_dtype: str) -> Path:
    """`final`: the model directory `source` loaded by slidetune (slide engine, CPU fp32) and exported
    at step 0, as a run's final/ is written."""
    from slidetune.checkpoint import ModelExport, save_checkpoint
    from slidetune.engine import AdamWConfig, RuntimeConfig, build_engine
    from slidetune.models.load import load_model
    engine = build_engine(load_model(str(source), with_tokenizer=False),
                          RuntimeConfig(mode="slide", dtype="fp32", device="cpu"), AdamWConfig(lr=1e-3))
    try:
        return save_checkpoint(engine, final, step=0, save_dtype=save_dtype, export=ModelExport(source_dir=source))
    finally:
        engine.close()


@pytest.mark.parametrize("save_dtype", ["fp32", "bf16"])
def test_final_keeps_the_routers_correction_biases(tmp_path, save_dtype):
    """A GLM-4.5 MoE source directory whose routers keep non-zero e_score_correction_bias buffers:
    the loader reads them, and final/ holds them under HF's names, FP32 (as the source and HF keep
    them, in a BF16 export too), so from_pretrained(final) is the source's model."""
    import torch
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from test_families import router_biases, router_config, router_model
    source = tmp_path / "model"
    hf = router_model(router_config(320))
    # the Hub's layout (transformers' save: the experts one tensor each), which final/ keeps
    hf.save_pretrained(str(source))
    biases = router_biases(hf)
    final = export_source(source, tmp_path / "final", save_dtype)
    with safe_open(str(final / "model.safetensors"), "pt") as f:
        for name, b in biases.items():
            assert f.get_slice(name).get_dtype() == "F32" and torch.equal(f.get_tensor(name), b), name
    again = AutoModelForCausalLM.from_pretrained(str(final), dtype=torch.float32).eval()
    assert all(torch.equal(router_biases(again)[n], b) for n, b in biases.items())
    if save_dtype == "fp32":
        ids = torch.randint(0, 320, (2, 12), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            torch.testing.assert_close(again(input_ids=ids).logits, hf(input_ids=ids).logits, rtol=1e-5, atol=1e-5)


def test_the_card_names_a_hub_base_model_and_the_held_out_losses():
    card = model_card(CardFacts("org/base", ["a.jsonl: 10 training sequences"], {"lr": 1e-5, "data": {"seq_len": 8}},
                                steps=3, loss_before=2.5, loss_after=2.25))
    assert card.startswith("---\nbase_model: org/base\n")
    assert "| 2.5000 | 2.2500 |" in card and "| data.seq_len | `8` |" in card and "| lr | `1e-05` |" in card
    assert "No held-out evaluation" in model_card(CardFacts(str(Path("/models/x")), [], {}, steps=1))


def _export(tmp_path) -> Path:
    """A real export (save_checkpoint with export=) of a tiny engine: final/ as a run writes it."""
    from slidetune.checkpoint import ModelExport, save_checkpoint
    from slidetune.engine import AdamWConfig, RuntimeConfig, build_engine
    from test_equivalence import make_loaded
    engine = build_engine(make_loaded("llama", False, layers=2), RuntimeConfig(mode="gpu", dtype="fp32", device="cpu"),
                          AdamWConfig())
    try:
        save_checkpoint(engine, tmp_path / "final", step=1, save_dtype="bf16", export=ModelExport(card="# card\n"))
        save_checkpoint(engine, tmp_path / "checkpoint-1", step=1)
    finally:
        engine.close()
    return tmp_path / "final"


def test_push_checks_and_lists_the_export_before_any_network(tmp_path, capsys, monkeypatch):
    from slidetune.cli import main
    final = _export(tmp_path)
    assert main(["push", str(final), "--repo", "org/model", "--dry-run"]) == 0
    listed = capsys.readouterr().out
    assert f"{final} -> org/model:" in listed and "  README.md" in listed and "  model.safetensors" in listed
    assert "trainer_state" not in listed and "rng.pt" not in listed
    # a resumable checkpoint, a bad repository name, a damaged file, and the offline setting: each named
    assert main(["push", str(tmp_path / "checkpoint-1"), "--repo", "org/model"]) == 2
    assert "a resumable checkpoint, not a model to publish" in capsys.readouterr().err
    assert main(["push", str(final), "--repo", "model"]) == 2
    assert "org/name" in capsys.readouterr().err
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert main(["push", str(final), "--repo", "org/model"]) == 2
    assert "HF_HUB_OFFLINE is set: pushing to the Hub needs the network" in capsys.readouterr().err
    (final / "README.md").write_text("# edited after the export\n")
    assert main(["push", str(final), "--repo", "org/model", "--dry-run"]) == 2
    assert "do not match its manifest" in capsys.readouterr().err


def test_final_of_gpt_oss_keeps_transformers_layout(tmp_path):
    """gpt-oss's MoE (router and experts with biases, fused `gate_up_proj` [E, H, 2I]): transformers
    saves it under the model's own names (no conversion rule), the loader reads that, and final/ holds
    the same names, shapes and values, so from_pretrained(final) is the source's model."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from test_families import gpt_oss_config, gpt_oss_model
    source = tmp_path / "model"
    hf = gpt_oss_model(gpt_oss_config(320))
    hf.save_pretrained(str(source))
    saved = load_file(str(source / "model.safetensors"))
    assert "model.layers.0.mlp.experts.gate_up_proj_bias" in saved and "model.layers.1.self_attn.sinks" in saved
    final = export_source(source, tmp_path / "final", "fp32")
    written = load_file(str(final / "model.safetensors"))
    assert written.keys() == saved.keys()
    assert all(torch.equal(written[k], saved[k]) for k in saved)
    again = AutoModelForCausalLM.from_pretrained(str(final), dtype=torch.float32).eval()
    ids = torch.randint(0, 320, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(again(input_ids=ids).logits, hf(input_ids=ids).logits, rtol=1e-6, atol=1e-6)
