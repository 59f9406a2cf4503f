"""Packing with document boundaries (packing "masked") against each document run alone.

A packed row of several documents, with position ids restarting per document and attention
masked per document ("slidetune_packed": transformers' packed-sequence mask), gives every
token the loss it has when its document is the model's whole input: FP32, 1e-5, through the
plain HF forward and through slide mode. Packing "causal" keeps the old behaviour (documents
see each other: the losses of later documents change).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from reference import ReferenceTrainer, build_reference
from slidetune.data import Batch, DataConfig, TokenDataset, collate
from slidetune.data.batch import IGNORE_INDEX, document_positions
from slidetune.engine import AdamWConfig, RuntimeConfig, build_engine
from slidetune.models.load import LoadedModel, RandomInit, skeleton
from slidetune.models.presets import tiny_config
from slidetune.models.units import SplitModel, run_layer
from slidetune.ops.packed_attention import IMPL_NAME, use_packed_attention

VOCAB = 256
EOS = 2
DOC_LENGTHS = ((5, 9, 4, 6), (11, 3, 10))      # two rows of 24 tokens, documents of these lengths


def make_loaded(family: str = "llama", tied: bool = False) -> LoadedModel:
    cfg = tiny_config(family, tied=tied, vocab_size=VOCAB, layers=3)
    return LoadedModel("tiny", SplitModel(skeleton(cfg)), RandomInit(3, std=0.1, bias_std=0.1), None)


def make_docs() -> list[list[torch.Tensor]]:
    """Per row, its documents: random tokens ending with EOS."""
    g = torch.Generator().manual_seed(7)
    rows = []
    for lengths in DOC_LENGTHS:
        docs = []
        for n in lengths:
            doc = torch.randint(3, VOCAB, (n,), generator=g)
            doc[-1] = EOS
            docs.append(doc)
        rows.append(docs)
    return rows


def packed_dataset(rows: list[list[torch.Tensor]], document_mask: bool) -> TokenDataset:
    """The documents as a TokenDataset of packed rows (one extra token ends each row's window)."""
    tokens, targets, doc_starts, starts, lengths = [], [], [], [], []
    offset = 0
    for docs in rows:
        row = torch.cat(docs + [torch.tensor([EOS])])               # [S+1]: last token = last label
        first = torch.zeros(row.numel(), dtype=torch.bool)
        first[torch.tensor([0] + [len(d) for d in docs]).cumsum(0)] = True   # the extra token too
        tokens.append(row)
        targets.append(torch.ones(row.numel(), dtype=torch.bool))
        doc_starts.append(first)
        starts.append(offset)
        lengths.append(row.numel())
        offset += row.numel()
    seq = lengths[0] - 1
    return TokenDataset(torch.cat(tokens).to(torch.int32), torch.cat(targets), torch.tensor(starts),
                        torch.tensor(lengths), seq, packed=True, doc_starts=torch.cat(doc_starts),
                        document_mask=document_mask)


def alone_losses(model, docs: list[torch.Tensor]) -> torch.Tensor:
    """[S] per-token losses of each document run alone (its own forward), laid out as packed;
    NaN at each document's last position (its next token belongs to another document)."""
    out = []
    for doc in docs:
        logits = model(input_ids=doc[None]).logits[0]                       # [n, V]
        loss = F.cross_entropy(logits[:-1], doc[1:], reduction="none")      # [n-1]
        out.append(torch.cat([loss, torch.tensor([float("nan")])]))
    return torch.cat(out)


def per_token_losses(model, batch: Batch) -> torch.Tensor:
    logits = model(input_ids=batch.input_ids, position_ids=batch.position_ids,
                   use_cache=False).logits                                  # [B, S, V]; a cache turns
    # transformers' packed-sequence detection off (masking_utils._preprocess_mask_arguments)
    return F.cross_entropy(logits.flatten(0, 1), batch.labels.flatten(), reduction="none",
                           ignore_index=IGNORE_INDEX).view(batch.labels.shape)          # [B, S]


def test_collate_restarts_positions_and_cuts_labels_at_documents():
    rows = make_docs()
    batch = collate(packed_dataset(rows, document_mask=True), [0, 1], pad_id=0)
    want = torch.cat([torch.arange(n) for n in DOC_LENGTHS[0]])
    assert batch.position_ids[0].tolist() == want.tolist()
    assert batch.document_ids()[1].tolist() == [0] * 11 + [1] * 3 + [2] * 10
    # the label of each document's last token (the next document's first) is ignored
    ends = torch.tensor(DOC_LENGTHS[0]).cumsum(0) - 1
    assert (batch.labels[0, ends] == IGNORE_INDEX).all()
    assert batch.num_target_tokens() == 2 * 24 - 4 - 3
    assert packed_dataset(rows, document_mask=True).num_target_tokens == batch.num_target_tokens()
    causal = collate(packed_dataset(rows, document_mask=False), [0, 1], pad_id=0)
    assert causal.position_ids is None and causal.num_target_tokens() == 48
    assert torch.equal(causal.input_ids, batch.input_ids)


def test_document_positions_start_each_row_at_zero():
    starts = torch.tensor([[False, False, True, False], [True, True, False, True]])
    assert document_positions(starts).tolist() == [[0, 1, 0, 1], [0, 0, 1, 0]]


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_reference_forward_matches_documents_alone(family):
    loaded = make_loaded(family)
    model = build_reference(loaded).eval()
    rows = make_docs()
    batch = collate(packed_dataset(rows, document_mask=True), [0, 1], pad_id=0)
    with torch.no_grad():
        alone = torch.stack([alone_losses(model, docs) for docs in rows])          # [B, S]
        use_packed_attention(model)
        assert model.config._attn_implementation == IMPL_NAME
        packed = per_token_losses(model, batch)                                     # [B, S]
    keep = batch.labels != IGNORE_INDEX
    assert torch.equal(keep, ~alone.isnan())
    torch.testing.assert_close(packed[keep], alone[keep], rtol=1e-5, atol=1e-6)


def test_causal_packing_keeps_documents_visible():
    """packing "causal": the old behaviour, later documents attend to earlier ones."""
    model = build_reference(make_loaded()).eval()
    rows = make_docs()
    batch = collate(packed_dataset(rows, document_mask=False), [0, 1], pad_id=0)
    with torch.no_grad():
        alone = alone_losses(model, rows[0])
        causal = per_token_losses(model, batch)[0]
        plain = F.cross_entropy(model(input_ids=batch.input_ids).logits[0], batch.labels[0], reduction="none")
    torch.testing.assert_close(causal, plain)                 # no mask, no position ids: plain causal LM
    first = DOC_LENGTHS[0][0] - 1
    torch.testing.assert_close(causal[:first], alone[:first], rtol=1e-5, atol=1e-6)  # document 0 sees nothing else
    assert (causal[first + 1:] - alone[first + 1:]).nan_to_num().abs().max() > 1e-3


@pytest.mark.parametrize("mode", ["slide", "gpu"])
def test_engine_matches_documents_alone(mode):
    """The engine's eval forward (slide mode; gpu mode: the plain engine), one target token at a
    time, gives each document's own losses; training steps on packed batches follow the HF
    reference with the same mask."""
    loaded = make_loaded("llama", tied=True)
    rows = make_docs()
    batch = collate(packed_dataset(rows, document_mask=True), [0, 1], pad_id=0)
    reference = build_reference(loaded)
    with torch.no_grad():
        alone = torch.stack([alone_losses(reference.eval(), docs) for docs in rows])    # [B, S]
    use_packed_attention(loaded.split.model)
    use_packed_attention(reference)
    rt = RuntimeConfig(mode=mode, dtype="fp32", device="cpu", head_chunk_tokens=16, chunk_mb=1)
    engine = build_engine(loaded, rt, AdamWConfig(lr=1e-3, eps=1e-6))
    try:
        # slide mode: every token on its own; gpu mode: each document's sum (fewer forwards)
        keep = batch.labels != IGNORE_INDEX
        groups = (keep.nonzero().tolist() if mode == "slide" else
                  [(b, doc) for b in range(2) for doc in range(len(DOC_LENGTHS[b]))])
        for b, t in groups:
            select = torch.zeros_like(keep)
            if mode == "slide":
                select[b, t] = True
            else:
                select[b] = keep[b] & (batch.document_ids()[b] == t)
            labels = torch.where(select, batch.labels, IGNORE_INDEX)
            loss, n = engine.eval_loss(Batch(batch.input_ids, labels, None, batch.position_ids))
            assert n == int(select.sum())
            assert loss == pytest.approx(float(alone[select].sum()), rel=1e-5, abs=1e-6), (b, t)
        trainer = ReferenceTrainer(reference.train(), lr=1e-3, eps=1e-6)
        for step in range(2):
            want, _ = _reference_step(trainer, batch)
            assert engine.train_step([batch], 1e-3).loss == pytest.approx(want, rel=1e-5), step
    finally:
        engine.close()


def _reference_step(trainer: ReferenceTrainer, batch: Batch) -> tuple[float, float]:
    """ReferenceTrainer.step with the batch's position ids (its own step passes none)."""
    model = trainer.model
    forward = model.forward
    model.forward = lambda input_ids, attention_mask=None: forward(input_ids=input_ids,
                                                                   position_ids=batch.position_ids, use_cache=False)
    try:
        return trainer.step([batch], 1e-3)
    finally:
        model.forward = forward


def test_compiled_layer_takes_a_new_document_mask_without_recompiling():
    """compile_layers: the mask is an input of the compiled layer (a fixed-shape bool tensor on
    CPU), so micro-batches with different document boundaries reuse one graph; so does a batch with
    no boundary (packed_mask builds its mask too: one document per row; it was None, a recompile)."""
    from torch._dynamo.testing import CompileCounter
    torch._dynamo.reset()
    loaded = make_loaded()
    split = loaded.split
    use_packed_attention(split.model)
    params = {n: torch.randn(p.shape) * 0.1 for n, p in split.layer_modules[0].named_parameters()}
    counter = CompileCounter()
    compiled = torch.compile(run_layer, backend=counter, dynamic=False)
    g = torch.Generator().manual_seed(0)
    for step in range(4):
        starts = torch.rand(2, 24, generator=g) < 0.2
        starts[:, 5 + step] = True                                   # a boundary in the first three batches
        if step == 3:
            starts[:] = False                                        # the last: one document a row
        kwargs = split.layer_kwargs(2, 24, torch.float32, torch.device("cpu"),
                                    position_ids=document_positions(starts))[0]
        assert kwargs["attention_mask"] is not None
        compiled(split.layer_modules[0], params, torch.randn(2, 24, split.hidden_size), kwargs)
    assert counter.frame_count == 1


def test_packing_flag_modes_and_old_spelling(tmp_path):
    from slidetune.config import build_config, load_yaml
    (tmp_path / "c.yaml").write_text("packing: off\n")        # YAML reads off as false
    assert build_config(load_yaml(tmp_path / "c.yaml")).data.packing == "off"
    assert DataConfig().packing == "masked"
    assert DataConfig(packing="causal").packed and not DataConfig(packing="off").packed
    assert DataConfig(packing=True).packing == "masked"          # the old boolean spelling
    assert DataConfig(packing="false").packing == "off"
    with pytest.raises(ValueError, match="masked, causal, off"):
        DataConfig(packing="docs")


def test_packing_bench_smoke(tmp_path, monkeypatch):
    """benchmarks/scripts/packing_bench.py --smoke: CSV and JSON with machine details and the ratio."""
    import importlib.util
    import json
    import sys
    from pathlib import Path
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "scripts" / "packing_bench.py"
    spec = importlib.util.spec_from_file_location("packing_bench", script)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    monkeypatch.setattr(sys, "argv", ["packing_bench.py", str(tmp_path), "--smoke"])
    bench.main()
    result = json.loads((tmp_path / "packing_bench.json").read_text())
    assert {r["variant"] for r in result["rows"]} == {"causal", "masked"}
    assert result["rows"][1]["attn_implementation"] == IMPL_NAME
    assert all(r["graphs_during_timing"] == 0 and r["step_ms_median"] > 0 for r in result["rows"])
    assert result["ratio_masked_over_causal"]["eager"] > 0 and "torch" in result["machine"]
    assert (tmp_path / "packing_bench.csv").read_text().startswith("variant,")


def test_gpt_oss_packed_rows_match_documents_alone():
    """gpt-oss (attention sinks, a sliding layer of window 8 and a full one): packed rows with
    document masks keep the sink attention, with the documents ANDed in from the position ids
    (transformers' gpt-oss builds its masks without them), and the slide engine's loss of each
    document equals transformers' eager gpt-oss on that document alone."""
    import copy

    from slidetune.models.load import StateDictSource
    from slidetune.ops.sink_attention import PACKED_IMPL_NAME
    from test_families import gpt_oss_config, gpt_oss_model
    config = gpt_oss_config(VOCAB)
    hf = gpt_oss_model(config)
    assert hf.config._attn_implementation == "eager"
    state = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    loaded = LoadedModel("gpt_oss", SplitModel(skeleton(copy.deepcopy(config))), StateDictSource(state), None)
    use_packed_attention(loaded.split.model)
    assert loaded.split.config._attn_implementation == PACKED_IMPL_NAME
    rows = make_docs()
    batch = collate(packed_dataset(rows, document_mask=True), [0, 1], pad_id=0)
    with torch.no_grad():
        alone = torch.stack([alone_losses(hf, docs) for docs in rows])               # [B, S]
    engine = build_engine(loaded, RuntimeConfig(mode="slide", dtype="fp32", device="cpu", head_chunk_tokens=16,
                                                chunk_mb=1), AdamWConfig(lr=1e-3, eps=1e-6))
    try:
        keep = batch.labels != IGNORE_INDEX
        for b in range(2):
            for doc in range(len(DOC_LENGTHS[b])):
                select = keep & (batch.document_ids() == doc)
                select[1 - b] = False
                labels = torch.where(select, batch.labels, IGNORE_INDEX)
                loss, n = engine.eval_loss(Batch(batch.input_ids, labels, None, batch.position_ids))
                assert n == int(select.sum())
                assert loss == pytest.approx(float(alone[select].sum()), rel=1e-5), (b, doc)
    finally:
        engine.close()
