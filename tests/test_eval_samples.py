"""Greedy samples at each evaluation (evaluation/samples.py, --eval-prompts): the engines' next-token
logits against transformers' own forward of the same weights, the prompt files read or refused by
line, and real tiny runs (tiny-llama, CPU) writing eval_samples.jsonl and the trackers' text, the
last samples being what transformers' greedy generate gives with the exported model.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from slidetune.checkpoint import save_checkpoint
from slidetune.config import TrainConfig
from slidetune.data.config import DataConfig
from slidetune.data.errors import DataError
from slidetune.engine.config import RuntimeConfig
from slidetune.evaluation.samples import (decode_completion, encode_prompt, greedy_completions, keep_samples_up_to,
                                     read_prompt_file, write_samples)
from slidetune.data.chat_template import load_chat_template
from slidetune.models.load import embedded_tokenizer
from slidetune.trainer import TrainingError, train
from test_checkpoint import batches, make_engine


@pytest.mark.parametrize("mode,family,tied", [("slide", "llama", False), ("gpu", "qwen3", True)])
def test_next_token_logits_are_the_models(tmp_path, mode, family, tied):
    """After a step, each row's logits at its last real position are transformers' on the saved weights
    (right padding after it changes nothing: attention is causal)."""
    eng = make_engine(mode, family, tied)
    eng.train_step(batches(0), 1e-3)
    eng.synchronize()
    save_checkpoint(eng, tmp_path / "m", step=1, tokenizer=None, save_dtype="fp32", with_optimizer=False)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "m", dtype=torch.float32).eval()
    ids = batches(5)[0].input_ids                                  # [2, 16]
    lengths = torch.tensor([5, 16])
    got = eng.next_token_logits(ids, lengths)                      # [2, V]
    with torch.no_grad():
        want = model(ids).logits[torch.arange(2), lengths - 1]    # [2, V]
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    eng.close()


def test_greedy_stops_at_eos_and_at_the_row_length():
    """A counting 'model' (next token = last token + 1): rows stop at EOS (not in the text), after
    max_new_tokens, or at seq_len tokens; a filler row pads a short batch."""
    def count_up(ids, lengths):                                    # [B, S], [B] -> [B, V]
        last = ids[torch.arange(ids.shape[0]), lengths - 1]
        return torch.nn.functional.one_hot((last + 1) % 50, 50).float()

    out = greedy_completions(count_up, [[1, 2], [10], [44, 45]], seq_len=8, rows=2, max_new_tokens=5,
                             eos_id=13, pad_id=0)
    assert out == [[3, 4, 5, 6, 7], [11, 12], [46, 47, 48, 49, 0]]
    assert greedy_completions(count_up, [[1, 2, 3, 4, 5, 6]], seq_len=8, rows=1, max_new_tokens=9,
                              eos_id=None, pad_id=0) == [[7, 8]]


def test_prompt_files_are_read_and_bad_lines_named(tmp_path):
    tok = embedded_tokenizer()
    qwen3 = load_chat_template("qwen3")
    txt = tmp_path / "p.txt"
    txt.write_text("The capital of France is\n\nOnce upon a time\n")
    assert [p.text for p in read_prompt_file(str(txt), tok, None)] == ["The capital of France is", "Once upon a time"]
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text(json.dumps({"prompt": "Hi"}) + "\n" + json.dumps({"messages": [
        {"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue."}]}) + "\n")
    plain, chat = read_prompt_file(str(jsonl), tok, qwen3)
    assert plain.text == "Hi"
    assert chat.text.endswith("<|im_start|>assistant\n") and "Name a colour." in chat.text
    assert "Blue." not in chat.text and chat.where == f"{jsonl}:2"
    jsonl.write_text(json.dumps({"prompt": "Hi"}) + "\n" + json.dumps({"text": "no"}) + "\n")
    with pytest.raises(DataError, match=r"p\.jsonl:2: an eval prompt is"):
        read_prompt_file(str(jsonl), tok, qwen3)
    with pytest.raises(DataError, match="--eval-prompts .*missing.txt: no such file"):
        read_prompt_file(str(tmp_path / "missing.txt"), tok, None)


def chats(n: int) -> list[dict]:
    return [{"messages": [{"role": "user", "content": f"Name a colour, number {i}."},
                          {"role": "assistant", "content": f"Blue, number {i}."}]} for i in range(n)]


def run_config(data: Path, out: Path, **kw) -> TrainConfig:
    return TrainConfig(model="tiny-llama", data=DataConfig(path=str(data), seq_len=64, chat_template="qwen3"),
                       runtime=RuntimeConfig(device="cpu", dtype="fp32"), batch_size=2, max_steps=2, eval_batches=1,
                       eval_max_new_tokens=6, progress=False, output_dir=str(out), report_to="csv", **kw)


def test_eval_samples_written_for_held_out_chats(tmp_path):
    """Chat data without --eval-prompts: the held-out conversation's prompt is sampled before step 1
    and after the last step, to eval_samples.jsonl and text.jsonl; the last sample is transformers'
    greedy generate on final/."""
    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps(c) + "\n" for c in chats(20)))
    out = tmp_path / "run"
    train(run_config(data, out))
    lines = [json.loads(line) for line in (out / "eval_samples.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [0, 2]                     # 5% of 20: one held-out conversation
    prompt = lines[-1]["prompt"]
    assert prompt.startswith("<|im_start|>user\nName a colour, number ") and prompt.endswith("<|im_start|>assistant\n")
    texts = [json.loads(line) for line in (out / "text.jsonl").read_text().splitlines()]
    assert [t["text"] for t in texts] == [r["prompt"] + r["completion"] for r in lines]

    tok = embedded_tokenizer()
    model = AutoModelForCausalLM.from_pretrained(out / "final", dtype=torch.float32).eval()
    ids = torch.tensor([encode_prompt(tok, prompt)])
    generated = model.generate(ids, max_new_tokens=6, do_sample=False, eos_token_id=tok.eos_token_id,
                               pad_token_id=tok.eos_token_id)[0, ids.shape[1]:].tolist()
    if tok.eos_token_id in generated:
        generated = generated[:generated.index(tok.eos_token_id)]
    assert lines[-1]["completion"] == decode_completion(tok, generated)


def test_eval_prompts_file_and_a_bad_one(tmp_path):
    """--eval-prompts FILE on chat data replaces the held-out prompts; a bad file stops the run before
    the engine is built, naming the line."""
    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps(c) + "\n" for c in chats(4)))   # too few to hold any out
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("The colour of the sky is\nTwo plus two is\n")
    out = tmp_path / "run"
    train(run_config(data, out, eval_prompts=str(prompts)))
    lines = [json.loads(line) for line in (out / "eval_samples.jsonl").read_text().splitlines()]
    assert [(r["step"], r["prompt"]) for r in lines] == [(0, "The colour of the sky is"), (0, "Two plus two is"),
                                                         (2, "The colour of the sky is"), (2, "Two plus two is")]
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": 3}) + "\n")
    with pytest.raises(TrainingError, match=r"bad\.jsonl:1: an eval prompt is"):
        train(run_config(data, tmp_path / "run2", eval_prompts=str(bad)))


def test_a_resume_keeps_the_samples_up_to_its_checkpoint_and_a_fresh_start_none(tmp_path):
    path = tmp_path / "eval_samples.jsonl"
    write_samples(path, 0, [("a", "x")])
    write_samples(path, 4, [("a", "y"), ("b", "z")])
    with path.open("a") as f:
        f.write('{"step": 8, "prom')                              # cut short by a kill
    keep_samples_up_to(path, 4)
    assert [json.loads(line)["completion"] for line in path.read_text().splitlines()] == ["x", "y", "z"]
    keep_samples_up_to(path, 2)
    assert [json.loads(line) for line in path.read_text().splitlines()] == [{"step": 0, "prompt": "a",
                                                                             "completion": "x"}]
    keep_samples_up_to(path, None)
    assert not path.exists()
