"""The chat data shapes beside `messages` (issue 48): ShareGPT's `conversations` and TRL's
conversational prompt-completion, each read as the chat it is, token for token; and their bad
records refused naming the file, the line and the field."""
from __future__ import annotations

import pytest

from slidetune.data import DataError
from slidetune.data.chat_template import load_chat_template
from slidetune.data.formats import SHAREGPT_ROLES, read_source
from slidetune.data.tokenization import tokenize_examples
from test_chat_templates import TWO_TURNS, qwen3  # noqa: F401 (a fixture)
from test_data import tok, tokenized, write_jsonl  # noqa: F401 (a fixture)

MESSAGES = [{"role": "system", "content": "a"}, {"role": "user", "content": "b c"},
            {"role": "assistant", "content": "d"}, {"role": "user", "content": "e"},
            {"role": "assistant", "content": "f g"}]
SHAREGPT = {"system": "a", "conversations": [{"from": "human", "value": "b c"}, {"from": "gpt", "value": "d"},
                                             {"from": "human", "value": "e"}, {"from": "gpt", "value": "f g"}]}


def test_sharegpt_is_the_chat_it_writes(tmp_path, tok):
    """A ShareGPT record (its system prompt at the top level) tokenizes as the `messages` record
    of the same conversation: the same ids, the same assistant targets."""
    chat = tokenized(write_jsonl(tmp_path / "m.jsonl", [{"messages": MESSAGES}]), tok)
    p = write_jsonl(tmp_path / "s.jsonl", [SHAREGPT, {"conversations": SHAREGPT["conversations"], "id": 3}])
    src = read_source(p)
    assert src.format == "chat" and src.examples[0].messages == MESSAGES
    assert src.examples[1].messages == MESSAGES[1:]                 # no system prompt
    (ex, _) = tokenize_examples(src.examples, tok, True, p)
    assert ex.ids == chat[0].ids and ex.targets == chat[0].targets


def test_sharegpt_speakers_map_to_chat_roles():
    assert {SHAREGPT_ROLES[k] for k in ("human", "gpt", "system", "observation", "function_call")} == {
        "user", "assistant", "system", "tool"}


@pytest.mark.parametrize("record, said", [
    ({"conversations": [{"from": "narrator", "value": "x"}]}, "conversations\\[0\\]\\['from'\\] is 'narrator'"),
    ({"conversations": [{"from": "human", "value": 3}]}, "conversations\\[0\\]\\['value'\\] must be a string, got int"),
    ({"conversations": []}, "'conversations' must be a non-empty list"),
    ({"conversations": ["hi"]}, "conversations\\[0\\] must be an object"),
    ({"conversations": [{"from": "human", "value": "x"}], "system": ["s"]}, "'system' must be a string"),
])
def test_a_bad_sharegpt_record_is_named(tmp_path, record, said):
    p = write_jsonl(tmp_path / "bad.jsonl", [SHAREGPT, record])
    with pytest.raises(DataError, match=f"{p}:2: {said}"):
        read_source(p)


def test_conversational_prompt_completion_trains_on_the_completion_alone(tmp_path, tok):
    """TRL's conversational prompt-completion: the prompt's turns (an assistant turn among them)
    are context, the completion's assistant turn the only target; the same text as the chat."""
    chat = tokenized(write_jsonl(tmp_path / "m.jsonl", [{"messages": MESSAGES}]), tok)[0]
    p = write_jsonl(tmp_path / "pc.jsonl", [{"prompt": MESSAGES[:4], "completion": MESSAGES[4:]}])
    src = read_source(p)
    assert src.format == "chat" and src.examples[0].prompt_turns == 4
    (ex,) = tokenize_examples(src.examples, tok, True, p)
    assert ex.ids == chat.ids
    first_reply = chat.ids.index(7) + 1                # the tokens after the system turn's <|end|>
    reply_d = [i for i, t in enumerate(chat.targets) if t][:2]   # "d <|end|>": the chat trains on it
    assert all(chat.targets[i] and not ex.targets[i] for i in reply_d) and reply_d[0] > first_reply
    assert [t for i, t in enumerate(ex.targets) if i > reply_d[-1]] == [t for i, t in enumerate(chat.targets)
                                                                         if i > reply_d[-1]]
    assert sum(ex.targets) == sum(chat.targets) - 2


def test_conversational_prompt_completion_with_a_generation_marked_template(tmp_path, qwen3):  # noqa: F811
    """With a template that marks the assistant's tokens ({% generation %}: the shipped qwen3), the
    prompt's assistant turn is unmarked too, and the completion's tokens are the chat's."""
    template = load_chat_template("qwen3")
    chat_src = read_source(write_jsonl(tmp_path / "m.jsonl", [{"messages": TWO_TURNS}]))
    (chat,) = tokenize_examples(chat_src.examples, qwen3, True, "m", chat_template=template)
    src = read_source(write_jsonl(tmp_path / "pc.jsonl", [{"prompt": TWO_TURNS[:4], "completion": TWO_TURNS[4:]}]))
    (ex,) = tokenize_examples(src.examples, qwen3, True, "pc", chat_template=template)
    assert ex.ids == chat.ids
    text = lambda flags: qwen3.decode([i for i, t in zip(ex.ids, flags) if t])  # noqa: E731
    assert "Hello there." in text(chat.targets) and "Hello there." not in text(ex.targets)
    assert text(ex.targets).endswith("Goodbye.<|im_end|>")
    k = ex.targets.index(True)                         # the completion's first target: the chat's from there
    assert ex.targets[k:] == chat.targets[k:]


@pytest.mark.parametrize("record, said", [
    ({"prompt": [{"role": "user", "content": "a"}], "completion": [{"role": "user", "content": "b"}]},
     "the completion has no assistant message"),
    ({"prompt": [], "completion": [{"role": "assistant", "content": "b"}]}, "\\(prompt\\): 'messages' is an empty list"),
    ({"prompt": [{"role": "user"}], "completion": [{"role": "assistant", "content": "b"}]},
     "\\(prompt\\): messages\\[0\\]\\['content'\\] must be a string, got missing"),
])
def test_a_bad_conversational_record_is_named(tmp_path, record, said):
    good = {"prompt": MESSAGES[:2], "completion": MESSAGES[2:3]}
    p = write_jsonl(tmp_path / "bad.jsonl", [good, record])
    with pytest.raises(DataError, match=f"{p}:2 ?{said}" if said.startswith("\\(") else f"{p}:2: {said}"):
        read_source(p)


def test_string_and_conversational_prompt_completion_do_not_mix(tmp_path):
    p = write_jsonl(tmp_path / "mixed.jsonl", [{"prompt": "a", "completion": "b"},
                                              {"prompt": MESSAGES[:2], "completion": MESSAGES[2:3]}])
    with pytest.raises(DataError, match="share one format"):
        read_source(p)


def test_sharegpt_from_parquet_is_the_same_chat(tmp_path, tok):
    """A ShareGPT set as most are published (parquet, read through `datasets`): the same chat."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from slidetune.data.sources import read_source as read_any
    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist([SHAREGPT, SHAREGPT]), path)
    src = read_any(str(path))
    assert src.format == "chat" and [ex.messages for ex in src.examples] == [MESSAGES, MESSAGES]
    assert src.examples[0].where == f"{path} row 1"


def test_the_token_cache_tells_a_prompt_completion_from_its_chat(tmp_path):
    """The same conversation as `messages` and as a conversational prompt-completion has other
    targets: the tokenized-data cache keys them apart (and a chat's key is what it was)."""
    from slidetune.data.token_cache import examples_key
    chat = read_source(write_jsonl(tmp_path / "m.jsonl", [{"messages": MESSAGES}])).examples
    pc = read_source(write_jsonl(tmp_path / "pc.jsonl", [{"prompt": MESSAGES[:4], "completion": MESSAGES[4:]}])).examples
    share = read_source(write_jsonl(tmp_path / "s.jsonl", [SHAREGPT])).examples
    key = lambda ex: examples_key(ex, "tok", True)[0]  # noqa: E731
    assert key(chat) != key(pc) and key(chat) == key(share)


# --------------------------------------------------------------------------- --data-columns
def test_columns_named_otherwise_are_read_through_the_map(tmp_path, tok):
    """--data-columns: a set whose columns are named otherwise (question/answer, content) reads as
    the format their mapped names make, from JSONL and through datasets, and tokenizes as that."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from slidetune.data import DataConfig
    from slidetune.data.build import load_source
    from slidetune.data.formats import ColumnMap
    qa = write_jsonl(tmp_path / "qa.jsonl", [{"question": "a b", "answer": "c d", "id": 1}])
    plain = write_jsonl(tmp_path / "pc.jsonl", [{"prompt": "a b", "completion": "c d"}])
    cfg = DataConfig(path=qa, columns="question=prompt, answer=completion")
    src = load_source(cfg)
    assert src.format == "prompt_completion"
    (mapped,), (named,) = tokenize_examples(src.examples, tok, True, qa), tokenized(plain, tok)
    assert (mapped.ids, mapped.targets) == (named.ids, named.targets)
    path = tmp_path / "texts.parquet"
    pq.write_table(pa.Table.from_pylist([{"content": "a b c", "text": "ignored"}]), path)
    src = load_source(DataConfig(path=str(path), columns="content=text"))
    assert src.format == "text" and src.examples[0].segments[0].text == "a b c"     # the mapped column wins
    assert ColumnMap.parse("  ") is None


@pytest.mark.parametrize("spec, said", [("question", "is not COLUMN=FIELD"), ("q=question", "not a record field"),
                                        ("a=text,b=text", "two columns map to one field")])
def test_a_bad_column_map_is_refused_before_anything_is_read(spec, said):
    from slidetune.data import DataConfig
    with pytest.raises(ValueError, match=f"--data-columns: .*{said}"):
        DataConfig(path="x.jsonl", columns=spec)


def test_a_record_without_a_mapped_column_is_named(tmp_path):
    from slidetune.data import DataConfig
    from slidetune.data.build import load_source
    p = write_jsonl(tmp_path / "qa.jsonl", [{"question": "a", "answer": "b"}, {"question": "c", "reply": "d"}])
    with pytest.raises(DataError, match=f"{p}:2: --data-columns maps column 'answer' to 'completion', but this "
                                        f"record has no 'answer'"):
        load_source(DataConfig(path=p, columns="question=prompt,answer=completion"))


def test_the_flag_sets_the_field():
    from slidetune.cli import build_parser
    from slidetune.config import config_from_args
    args = build_parser().parse_args(["train", "--data", "x.jsonl", "--data-columns", "content=text"])
    assert config_from_args(args).data.columns == "content=text"


def test_records_given_in_python_read_as_a_files_rows():
    """hf_datasets.in_memory_source: a datasets.Dataset or a list of dicts, its columns mapped, bad
    rows named by the source and the row; an IterableDataset read whole (an evaluation set, pairs),
    a generator refused (it reads once)."""
    import datasets
    from slidetune.data.formats import ColumnMap
    from slidetune.data.hf_datasets import in_memory_source
    ds = datasets.Dataset.from_list([{"q": "a b", "a": "c"}, {"q": "d", "a": "e"}])
    src = in_memory_source(ds, ColumnMap.parse("q=prompt,a=completion"))
    assert src.format == "prompt_completion" and src.name.startswith("<datasets.Dataset of 2 rows, fingerprint")
    assert [seg.text for seg in src.examples[1].segments] == ["d", "e"]
    listed = in_memory_source([SHAREGPT])
    assert listed.format == "chat" and listed.examples[0].messages == MESSAGES
    with pytest.raises(DataError, match=r"<2 records given in Python> row 2: keys \['x'\] match no known format"):
        in_memory_source([{"text": "a"}, {"x": 1}])
    streamed = in_memory_source(ds.to_iterable_dataset(), ColumnMap.parse("q=prompt,a=completion"))
    assert streamed.name == "<datasets.IterableDataset given in Python>"
    assert [seg.text for seg in streamed.examples[1].segments] == ["d", "e"]
    with pytest.raises(DataError, match="can be read only once"):
        in_memory_source(row for row in [SHAREGPT])
