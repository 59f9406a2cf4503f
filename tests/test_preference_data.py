"""Preference records (data/preference.py, issue 47): TRL's standard and conversational formats,
the implicit prompt by TRL's rule, and the errors that name the record and the field."""
from __future__ import annotations

import pytest
import torch

from slidetune.data import DataError
from slidetune.data.formats import ColumnMap, Segment, parse_record
from slidetune.data.preference import (collate_pairs, drop_unscored, implicit_prompt, is_preference, parse_pair,
                                       tokenize_pair)
from test_chat_templates import PHI35_PUBLISHED, QWEN3_PUBLISHED, byte_tokenizer
from test_data import make_tokenizer

USER = {"role": "user", "content": "What color is the sky?"}
BLUE = {"role": "assistant", "content": "It is blue."}
GREEN = {"role": "assistant", "content": "It is green."}


def test_a_standard_pair_is_two_prompt_completion_examples():
    pair = parse_pair({"prompt": "The sky is", "chosen": " blue.", "rejected": " green."}, "p.jsonl line 1")
    assert pair.chosen.segments == [Segment("The sky is", False), Segment(" blue.", True)]
    assert pair.rejected.segments == [Segment("The sky is", False), Segment(" green.", True)]
    assert pair.chosen.format == pair.rejected.format == "prompt_completion" and not pair.implicit_prompt
    assert pair.chosen.where == "p.jsonl line 1 (chosen)" and pair.where == "p.jsonl line 1"


def test_a_conversational_pair_keeps_the_prompt_turns_out_of_the_loss():
    tools = [{"type": "function", "function": {"name": "look", "parameters": {}}}]
    pair = parse_pair({"prompt": [USER], "chosen": [BLUE], "rejected": [GREEN], "tools": tools}, "row 3")
    assert pair.chosen.messages == [USER, BLUE] and pair.rejected.messages == [USER, GREEN]
    assert pair.chosen.prompt_turns == pair.rejected.prompt_turns == 1
    assert pair.chosen.tools == tools
    # the same record as SFT's conversational prompt-completion reads the chosen side
    assert parse_record({"prompt": [USER], "completion": [BLUE]}, "row 3 (chosen)").messages == pair.chosen.messages


@pytest.mark.parametrize("chosen, rejected, expected", [
    # TRL's documented example: the space before the completions goes with them
    ("The sky is blue.", "The sky is green.", ("The sky is", " blue.", " green.")),
    ("ab", "ac", ("a", "b", "c")),
    # one side a prefix of the other: TRL's loop stops one element short of the shorter side
    ("ab", "abc", ("a", "b", "bc")),
    ([USER, BLUE], [USER, GREEN], ([USER], [BLUE], [GREEN])),
])
def test_the_implicit_prompt_is_the_shared_prefix_by_trls_rule(chosen, rejected, expected):
    assert implicit_prompt(chosen, rejected) == expected
    pair = parse_pair({"chosen": chosen, "rejected": rejected}, "line 1")
    assert pair.implicit_prompt
    side = pair.chosen.segments[1].text if isinstance(chosen, str) else pair.chosen.messages[len(expected[0]):]
    assert side == expected[1]


def test_a_column_map_renames_before_the_pair_is_read():
    cols = ColumnMap.parse("question=prompt,good=chosen,bad=rejected")
    pair = parse_pair({"question": "Q", "good": " yes", "bad": " no"}, "line 1", cols)
    assert pair.chosen.segments[1] == Segment(" yes", True)
    assert is_preference({"prompt", "chosen", "rejected"}) and not is_preference({"prompt", "completion"})


@pytest.mark.parametrize("record, said", [
    ({"prompt": "P", "chosen": " a"}, "'rejected' is missing"),
    ({"prompt": "P", "chosen": [BLUE], "rejected": " no"}, "'rejected' is a str but 'chosen' is a list of messages"),
    ({"prompt": [USER], "chosen": " a", "rejected": " b"}, "'prompt' is a list of messages but 'chosen' is a str"),
    ({"prompt": "P", "chosen": "  ", "rejected": " b"}, "'chosen' is empty: each side"),
    ({"chosen": "same", "rejected": "same"}, "'chosen' and 'rejected' are the same"),
    ({"chosen": "ab ", "rejected": "ab c"}, "'chosen' is empty once the prompt both sides share is taken out"),
    ({"chosen": [BLUE], "rejected": [USER, GREEN]}, "share no message"),
    ({"prompt": [USER], "chosen": [USER], "rejected": [GREEN]}, r"\(chosen\): the completion has no assistant"),
    ({"prompt": [USER], "chosen": [{"role": "assistant"}], "rejected": [GREEN]}, r"messages\[0\]\['content'\]"),
])
def test_a_bad_pair_is_refused_naming_the_record_and_field(record, said):
    with pytest.raises(DataError, match=f"line 7.*{said}"):
        parse_pair(record, "line 7")


def test_sft_names_a_preference_record_and_the_rename_that_trains_its_chosen_side():
    with pytest.raises(DataError, match="preference record .*--data-columns chosen=completion"):
        parse_record({"prompt": "P", "chosen": " a", "rejected": " b"}, "line 2")
    renamed = parse_record({"prompt": "P", "chosen": " a", "rejected": " b"}, "line 2",
                           ColumnMap.parse("chosen=completion"))
    assert renamed.segments == [Segment("P", False), Segment(" a", True)]


# --- tokens as TRL's DPOTrainer makes them (trl pinned in the test extra) ---------------------

STANDARD = [{"prompt": "a b c", "chosen": " d e", "rejected": " f"},
            {"prompt": "a", "chosen": " b", "rejected": " c d e f g h"}]
STANDARD_IMPLICIT = [{"chosen": "a b c d", "rejected": "a b c e f"}, {"chosen": "a b", "rejected": "a c d"}]
SECOND = {"role": "assistant", "content": "Green, mostly."}
CHATS = [{"prompt": [{"role": "system", "content": "Be brief."}, USER], "chosen": [BLUE], "rejected": [GREEN]},
         {"prompt": [USER, BLUE, {"role": "user", "content": "Sure?"}],
          "chosen": [{"role": "assistant", "content": "Yes."}], "rejected": [{"role": "assistant", "content": "No."}]}]
CHATS_IMPLICIT = [{"chosen": [USER, BLUE], "rejected": [USER, SECOND]},
                  {"chosen": [{"role": "system", "content": "Be brief."}, USER, GREEN],
                   "rejected": [{"role": "system", "content": "Be brief."}, USER, BLUE]}]


def _trl(records, tokenizer, max_length):
    """TRL's own preprocessing (DPOTrainer._prepare_dataset: prompt extraction, EOS, tokenizing, the
    drop of fully cut pairs) and collator, on `records`."""
    import tempfile
    import types

    from datasets import Dataset
    from trl import DPOConfig
    from trl.trainer.dpo_trainer import DataCollatorForPreference, DPOTrainer
    args = DPOConfig(output_dir=tempfile.mkdtemp(), report_to=[], max_length=max_length, bf16=False, use_cpu=True,
                     dataset_num_proc=None)
    trainer = types.SimpleNamespace(_tokenizer=tokenizer, _is_vision_dataset=False)
    ds = DPOTrainer._prepare_dataset(trainer, Dataset.from_list(records), tokenizer, args, "train")
    rows = [{k: r[k] for k in ("prompt_ids", "chosen_ids", "rejected_ids")} for r in ds]
    if not rows:                                      # every pair left out: nothing to collate
        return rows, None
    return rows, DataCollatorForPreference(pad_token_id=tokenizer.pad_token_id, max_length=max_length)(rows)


def _ours(records, tokenizer, max_length):
    pairs = [tokenize_pair(parse_pair(r, f"line {i + 1}"), tokenizer) for i, r in enumerate(records)]
    pairs = drop_unscored(pairs, max_length, "test")
    rows = [{"prompt_ids": p.prompt, "chosen_ids": p.chosen, "rejected_ids": p.rejected} for p in pairs]
    return rows, collate_pairs(pairs, tokenizer.pad_token_id, max_length) if pairs else None


@pytest.mark.parametrize("case", ["standard", "qwen3", "phi35"])
@pytest.mark.parametrize("implicit", [False, True])
@pytest.mark.parametrize("max_length", [None, 4, 12])
def test_pairs_tokenize_and_collate_as_trls_dpo_trainer(case, implicit, max_length):
    """Each of TRL's preference formats (a dataset is all explicit or all implicit prompts, as TRL
    reads it), with and without max_length, on a word tokenizer and two published chat templates:
    the same prompt, chosen and rejected ids, the same dropped pairs, the same batch tensors."""
    if case == "standard":
        tokenizer, records = make_tokenizer(), STANDARD_IMPLICIT if implicit else STANDARD
    elif case == "qwen3":
        tokenizer = byte_tokenizer(QWEN3_PUBLISHED, ["<|im_start|>", "<|im_end|>", "<|endoftext|>"],
                                   eos_token="<|im_end|>", pad_token="<|endoftext|>")
        records = CHATS_IMPLICIT if implicit else CHATS
    else:
        tokenizer = byte_tokenizer(PHI35_PUBLISHED, ["<s>", "<unk>", "<|endoftext|>", "<|system|>", "<|user|>",
                                                     "<|assistant|>", "<|end|>"],
                                   bos_token="<s>", eos_token="<|endoftext|>", pad_token="<|endoftext|>")
        records = CHATS_IMPLICIT if implicit else CHATS
    length = None if max_length is None else max_length * (1 if case == "standard" else 12)
    theirs_rows, theirs = _trl(records, tokenizer, length)
    ours_rows, ours = _ours(records, tokenizer, length)
    assert ours_rows == theirs_rows
    if theirs is not None:
        assert set(ours) == set(theirs) and all(torch.equal(ours[k], theirs[k]) for k in theirs)


def test_a_fixed_width_pads_every_batch_alike():
    tok = make_tokenizer()
    pairs = [tokenize_pair(parse_pair(r, "line"), tok) for r in STANDARD]
    wide = collate_pairs(pairs, tok.pad_token_id, pad_to=16)
    tight = collate_pairs(pairs, tok.pad_token_id)
    assert wide["input_ids"].shape == (4, 16)
    s = tight["input_ids"].shape[1]
    assert all(torch.equal(wide[k][:, :s], tight[k]) for k in tight)
    assert not wide["attention_mask"][:, s:].any() and (wide["input_ids"][:, s:] == tok.pad_token_id).all()
    with pytest.raises(ValueError, match="longer than pad_to = 4"):
        collate_pairs(pairs, tok.pad_token_id, pad_to=4)
