"""Preference records (data/preference.py, issue 47): TRL's standard and conversational formats,
the implicit prompt by TRL's rule, and the errors that name the record and the field."""
from __future__ import annotations

import pytest

from slidetune.data import DataError
from slidetune.data.formats import ColumnMap, Segment, parse_record
from slidetune.data.preference import implicit_prompt, is_preference, parse_pair

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
