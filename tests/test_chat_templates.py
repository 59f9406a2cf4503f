"""Chat templates: `--chat-template FILE|NAME`, assistant masks from {% generation %} blocks, tool calls.

tests/fixtures/chat_templates/ holds the chat templates Qwen3 and Phi-3.5-mini-instruct publish in
their tokenizer_config.json, written out from their published Jinja text (no Hub download). Both
are refused by the prefix-rendering comparison on multi-turn chats (Qwen3 renders a thinking block
only after the last user query; Phi-3.5 writes EOS after the last message); the shipped training
copies (src/slidetune/data/templates) render the same text and mark the assistant's tokens.

The tokenizers are real byte-level BPE tokenizers without merges (one token per byte) plus the
models' special tokens, so every rendered character is a token and decoded runs are exact.
"""
from __future__ import annotations

import itertools
import json
import re
from pathlib import Path

import pytest

from slidetune.cli import build_parser
from slidetune.config import config_from_args
from slidetune.data import IGNORE_INDEX, DataConfig, DataError, build_datasets, collate
from slidetune.data.chat_template import load_chat_template, marks_generation, shipped_templates
from slidetune.data.formats import read_source
from slidetune.data.tokenization import tokenize_examples

FIXTURES = Path(__file__).parent / "fixtures" / "chat_templates"
QWEN3_PUBLISHED = (FIXTURES / "qwen3.jinja").read_text()
PHI35_PUBLISHED = (FIXTURES / "phi3.5.jinja").read_text()


def byte_tokenizer(chat_template: str, special: list[str], **roles: str):
    """A fast byte-level tokenizer (256 byte tokens, no merges) with ``special`` tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, additional_special_tokens=special, **roles)
    tok.chat_template = chat_template
    return tok


@pytest.fixture(scope="module")
def qwen3():
    # Qwen3's instruct tokenizers: EOS <|im_end|>, pad <|endoftext|>, no BOS
    return byte_tokenizer(QWEN3_PUBLISHED, ["<|im_start|>", "<|im_end|>", "<|endoftext|>"],
                          eos_token="<|im_end|>", pad_token="<|endoftext|>")


@pytest.fixture(scope="module")
def phi35():
    # Phi-3.5-mini-instruct: BOS <s>, EOS and pad <|endoftext|>, role and end-of-turn tokens
    return byte_tokenizer(PHI35_PUBLISHED, ["<s>", "<unk>", "<|endoftext|>", "<|system|>", "<|user|>",
                                            "<|assistant|>", "<|end|>"],
                          bos_token="<s>", eos_token="<|endoftext|>", pad_token="<|endoftext|>",
                          unk_token="<unk>")


TWO_TURNS = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
             {"role": "assistant", "content": "Hello there."}, {"role": "user", "content": "Bye"},
             {"role": "assistant", "content": "Goodbye."}]
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TOOL_CHAT = [{"role": "user", "content": "Weather in Paris?"},
             {"role": "assistant", "content": None,
              "tool_calls": [{"type": "function",
                              "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
             {"role": "tool", "content": "sunny, 21 C"},
             {"role": "assistant", "content": "It is sunny."}]
THINKING = [{"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": "4", "reasoning_content": "Two and two."},
            {"role": "user", "content": "3+3?"},
            {"role": "assistant", "content": "<think>\nThree and three.\n</think>\n\n6"}]


def write_jsonl(path: Path, records: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def label_runs(tok, data: str, **cfg) -> tuple[list[list[str]], list[str]]:
    """Per row of the built train split: the decoded runs of labels != -100, and the decoded inputs."""
    cfg.setdefault("heldout_fraction", 0.0)
    train, _ = build_datasets(DataConfig(path=data, **cfg), tok)
    batch = collate(train, range(len(train)), pad_id=tok.pad_token_id)
    runs, inputs = [], []
    for row_ids, row_labels in zip(batch.input_ids.tolist(), batch.labels.tolist()):
        row_runs, cur = [], []
        for label in row_labels + [IGNORE_INDEX]:
            if label != IGNORE_INDEX:
                cur.append(label)
            elif cur:
                row_runs.append(tok.decode(cur))
                cur = []
        runs.append(row_runs)
        inputs.append(tok.decode(row_ids))
    return runs, inputs


def test_shipped_templates_mark_generation_and_are_listed():
    assert {"qwen3", "phi3.5"} <= set(shipped_templates())
    for name in ("qwen3", "phi3.5"):
        assert marks_generation(load_chat_template(name))
    assert not marks_generation(QWEN3_PUBLISHED) and not marks_generation(PHI35_PUBLISHED)


@pytest.mark.parametrize("messages, tools", [(TWO_TURNS, None), (TWO_TURNS[1:3], None), (THINKING, None),
                                             (TOOL_CHAT, [WEATHER_TOOL]), (TWO_TURNS, [WEATHER_TOOL])])
@pytest.mark.parametrize("generation_prompt", [False, True])
def test_qwen3_training_template_renders_the_published_text(qwen3, messages, tools, generation_prompt):
    shipped = load_chat_template("qwen3")
    for conversation in (messages, messages[:-1]):
        kw = dict(tools=tools, tokenize=False, add_generation_prompt=generation_prompt)
        assert (qwen3.apply_chat_template(conversation, chat_template=shipped, **kw)
                == qwen3.apply_chat_template(conversation, **kw))


@pytest.mark.parametrize("generation_prompt", [False, True])
def test_phi35_training_template_renders_the_published_text(phi35, generation_prompt):
    shipped = load_chat_template("phi3.5")
    for conversation in (TWO_TURNS, TWO_TURNS[1:3], TWO_TURNS[1:4]):
        kw = dict(tokenize=False, add_generation_prompt=generation_prompt)
        assert (phi35.apply_chat_template(conversation, chat_template=shipped, **kw)
                == phi35.apply_chat_template(conversation, **kw))


@pytest.mark.parametrize("tok_name, template, runs", [
    ("qwen3", "qwen3", ["Hello there.<|im_end|>", "<think>\n\n</think>\n\nGoodbye.<|im_end|>"]),
    ("phi35", "phi3.5", ["Hello there.<|end|>", "Goodbye.<|end|>"])])
def test_published_templates_use_the_shipped_masks_with_a_warning(tmp_path, request, tok_name, template, runs):
    """Without --chat-template the published templates defeat the prefix comparison on two turns;
    the shipped copy renders the same text, so its masks are used, with a warning naming it."""
    tok = request.getfixturevalue(tok_name)
    data = write_jsonl(tmp_path / "chat.jsonl", [{"messages": TWO_TURNS}])
    src = read_source(data)
    with pytest.warns(UserWarning, match=rf"the shipped template {re.escape(template)} renders these chats to "
                                         rf"the same text.*--chat-template {re.escape(template)}"):
        (ex,) = tokenize_examples(src.examples, tok, True, src.name)
    (marked,) = tokenize_examples(src.examples, tok, True, src.name, load_chat_template(template))
    assert (ex.ids, ex.targets) == (marked.ids, marked.targets)
    assert [tok.decode([i for i, _ in g]) for t, g in itertools.groupby(zip(ex.ids, ex.targets),
                                                                         key=lambda p: p[1]) if t] == runs


def test_a_template_that_defeats_the_comparison_and_matches_no_shipped_one_is_refused(tmp_path, qwen3):
    altered = QWEN3_PUBLISHED.replace("'<|im_start|>' + message.role + '\\n' + content + '<|im_end|>'",
                                      "'<|im_start|>' + message.role + ':\\n' + content + '<|im_end|>'")
    assert altered != QWEN3_PUBLISHED
    tok = byte_tokenizer(altered, ["<|im_start|>", "<|im_end|>", "<|endoftext|>"], eos_token="<|im_end|>")
    data = write_jsonl(tmp_path / "chat.jsonl", [{"messages": TWO_TURNS}])
    src = read_source(data)
    with pytest.raises(DataError, match=r"cannot locate assistant message 2.*--chat-template FILE.*qwen3"):
        tokenize_examples(src.examples, tok, True, src.name)


@pytest.mark.parametrize("packing", ["masked", "off"])
def test_qwen3_two_turns_train_on_the_assistant_replies_only(tmp_path, qwen3, packing):
    data = write_jsonl(tmp_path / "chat.jsonl", [{"messages": TWO_TURNS}])
    runs, inputs = label_runs(qwen3, data, chat_template="qwen3", seq_len=256, packing=packing)
    # labels are -100 everywhere but on the replies and their <|im_end|> (TRL's assistant masks):
    # the headers, the prompt turns and the "\n" after each <|im_end|> are not trained on
    assert runs == [["Hello there.<|im_end|>", "<think>\n\n</think>\n\nGoodbye.<|im_end|>"]]
    full = qwen3.apply_chat_template(TWO_TURNS, tokenize=False)
    assert inputs[0].startswith(full[:-1])  # the input is the rendering (its last token is a label only)
    assert not inputs[0][len(full) - 1:].strip("\n<|endoftext|>")  # then padding: no EOS added


def test_phi35_two_turns_train_on_the_assistant_replies_only(tmp_path, phi35):
    data = write_jsonl(tmp_path / "chat.jsonl", [{"messages": TWO_TURNS}])
    runs, inputs = label_runs(phi35, data, chat_template="phi3.5", seq_len=256)
    # the replies and their <|end|>; not the "\n" after it, nor the template's closing <|endoftext|>
    assert runs == [["Hello there.<|end|>", "Goodbye.<|end|>"]]
    full = phi35.apply_chat_template(TWO_TURNS, tokenize=False)
    assert full.endswith("<|end|>\n<|endoftext|>")
    # BOS prepended (the template writes none), the template's EOS kept, none added
    assert inputs[0].startswith("<s>" + full[:-len("<|endoftext|>")])


def test_phi35_without_prompt_masking_trains_on_everything_but_bos(tmp_path, phi35):
    data = write_jsonl(tmp_path / "chat.jsonl", [{"messages": TWO_TURNS}])
    runs, _ = label_runs(phi35, data, chat_template="phi3.5", seq_len=256, mask_prompt=False)
    assert runs == [[phi35.apply_chat_template(TWO_TURNS, tokenize=False)]]


def test_qwen3_tool_calls_and_tools_reach_the_template(tmp_path, qwen3):
    data = write_jsonl(tmp_path / "tools.jsonl", [{"messages": TOOL_CHAT, "tools": [WEATHER_TOOL]}])
    src = read_source(data)
    assert src.examples[0].tools == [WEATHER_TOOL] and src.examples[0].messages[1]["content"] is None
    runs, inputs = label_runs(qwen3, data, chat_template="qwen3", seq_len=1024)  # ~800 byte tokens
    assert runs == [['<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>',
                     "<think>\n\n</think>\n\nIt is sunny.<|im_end|>"]]
    # the tool schema is in the (untrained) system prompt, the tool's answer in an untrained user turn
    assert inputs[0].startswith("<|im_start|>system\n# Tools") and '"name": "get_weather"' in inputs[0]
    assert "<tool_response>\nsunny, 21 C\n</tool_response>" in inputs[0]


def test_tools_as_a_json_string_and_bad_tool_records(tmp_path):
    data = write_jsonl(tmp_path / "tools.jsonl", [{"messages": TOOL_CHAT, "tools": json.dumps([WEATHER_TOOL])}])
    assert read_source(data).examples[0].tools == [WEATHER_TOOL]
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"messages": TOOL_CHAT, "tools": {"name": "x"}}])
    with pytest.raises(DataError, match=rf"{bad}:1: 'tools' must be a list of tool schema objects, got dict"):
        read_source(bad)
    no_calls = [{"role": "user", "content": "a"}, {"role": "assistant", "content": None}]
    bad = write_jsonl(tmp_path / "null.jsonl", [{"messages": no_calls}])
    with pytest.raises(DataError, match=r"messages\[1\]\['content'\] must be a string, got NoneType"):
        read_source(bad)


def test_qwen3_thinking_turns(tmp_path, qwen3):
    data = write_jsonl(tmp_path / "think.jsonl", [{"messages": THINKING}])
    runs, _ = label_runs(qwen3, data, chat_template="qwen3", seq_len=256)
    # as the published template renders them: the earlier turn's reasoning is dropped (it precedes the
    # last query), the last turn's is kept
    assert runs == [["4<|im_end|>", "<think>\nThree and three.\n</think>\n\n6<|im_end|>"]]


def test_chat_template_from_a_file(tmp_path, qwen3):
    tmpl = tmp_path / "mine.jinja"
    # (transformers renders with trim_blocks: a newline right after a block tag is dropped)
    tmpl.write_text("{% for m in messages %}{% if m.role == 'assistant' %}A: {% generation %}{{ m.content }}"
                    "<|im_end|>{% endgeneration %}{{ '\\n' }}{% else %}U: {{ m.content }}\n{% endif %}"
                    "{% endfor %}")
    data = write_jsonl(tmp_path / "chat.jsonl", [{"messages": TWO_TURNS[1:]}])
    runs, inputs = label_runs(qwen3, data, chat_template=str(tmpl), seq_len=128)
    assert runs == [["Hello there.<|im_end|>", "Goodbye.<|im_end|>"]]
    assert inputs[0].startswith("U: Hi\nA: Hello there.<|im_end|>\nU: Bye\nA: Goodbye.<|im_end|>\n")


def test_bad_chat_template_settings_are_refused_by_name(tmp_path):
    with pytest.raises(ValueError, match=r"chat_template \(--chat-template\) 'qwen9' is neither a file nor .*qwen3"):
        DataConfig(chat_template="qwen9")
    empty = tmp_path / "empty.jinja"
    empty.write_text(" \n")
    with pytest.raises(DataError, match=rf"--chat-template {empty}: the file is empty"):
        load_chat_template(str(empty))


@pytest.mark.parametrize("text, line, what", [
    ("{% for m in messages %}\n{{ m.content }\n{% endfor %}", "line 2 (`{{ m.content }`)", "unexpected '}'"),
    ("{% for m in messages %}\n{{ m.content | shout }}\n{% endfor %}", "line 2 (`{{ m.content | shout }}`)",
     "No filter named 'shout'"),
    ("{% for m in messages %}\n{% if m.role == 'user' %}U: {{ m.content }}\n{% endfor %}", "line 3 (`{% endfor %}`)",
     "Encountered unknown tag 'endfor'")])
def test_a_template_file_with_a_jinja_error_is_named_with_its_line_before_any_data(tmp_path, text, line, what):
    """Not "the tokenizer's chat template failed on this conversation" at a data line: the file and
    the Jinja error's line, when the setting is checked (DataConfig, so the flag, YAML and the API
    alike), before a model is loaded or a line of data read."""
    from test_train_errors import run_cli
    bad = tmp_path / "mine.jinja"
    bad.write_text(text)
    message = f"--chat-template {bad}: not a valid Jinja template: {line}: {what}"
    with pytest.raises(DataError) as e:
        load_chat_template(str(bad))
    assert str(e.value).startswith(message)
    with pytest.raises(DataError) as e:
        DataConfig(path=write_jsonl(tmp_path / "chat.jsonl", [{"messages": TWO_TURNS}]), chat_template=str(bad))
    assert str(e.value).startswith(message)
    code, _, err = run_cli("--data", str(tmp_path / "chat.jsonl"), "--chat-template", str(bad), "--model",
                           str(tmp_path / "no-model-loaded"), "--output-dir", str(tmp_path / "run"))
    assert code == 2 and message in err and "chat.jsonl" not in err, err


def test_chat_template_and_packing_strategy_flags():
    cfg = config_from_args(build_parser().parse_args(["train", "--chat-template", "qwen3",
                                                      "--packing-strategy", "wrapped"]))
    assert cfg.data.chat_template == "qwen3" and cfg.data.packing_strategy == "wrapped"
    with pytest.raises(ValueError, match="packing_strategy must be one of auto, bfd, wrapped"):
        DataConfig(packing_strategy="first-fit")


@pytest.mark.slow
def test_multi_turn_chats_train_end_to_end_with_the_shipped_qwen3_template(tmp_path):
    """`slidetune train --chat-template qwen3` on two-turn chats (the embedded SmolLM2 tokenizer has
    Qwen3's ChatML tokens): they train, packed whole, with the loss on both assistant turns."""
    from test_train_errors import run_cli

    from slidetune.models.load import embedded_tokenizer

    chats = [{"messages": [{"role": "user", "content": f"Name a colour, number {i}."},
                           {"role": "assistant", "content": f"Blue, number {i}."},
                           {"role": "user", "content": "Another?"},
                           {"role": "assistant", "content": f"Green, number {i + 1}."}]} for i in range(40)]
    data = write_jsonl(tmp_path / "chats.jsonl", chats)
    src = read_source(data)
    tok = embedded_tokenizer()
    (ex,) = tokenize_examples(src.examples[:1], tok, True, data, load_chat_template("qwen3"))
    runs = [tok.decode([i for i, _ in group]) for target, group in
            itertools.groupby(zip(ex.ids, ex.targets), key=lambda pair: pair[1]) if target]
    assert runs == ["Blue, number 0.<|im_end|>", "<think>\n\n</think>\n\nGreen, number 1.<|im_end|>"]
    out = tmp_path / "run"
    code, stdout, err = run_cli("--model", "tiny-llama", "--max-steps", "2", "--device", "cpu", "--progress", "false",
                                "--batch-size", "2", "--seq-len", "128", "--eval-batches", "2", "--data", data,
                                "--chat-template", "qwen3", "--output-dir", str(out))
    assert code == 0, (stdout[-2000:], err[-3000:])
    assert "the 38 training examples are packed whole into" in err
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 2 and 2 <= summary["train_sequences"] < 38
