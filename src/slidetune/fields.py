"""The one check of a configuration field: its type, its choices and its range.

Every config dataclass (TrainConfig, DataConfig, AdamWConfig, RuntimeConfig and its tuning
sections) calls `check_fields` from its `__post_init__`, so a value is checked by the same rule
and refused with the same message whichever way it came: a flag (config.py parses the text into
the field's type first), a YAML or JSON file (config.py's _coerce converts YAML's scalars first)
or Python (`TrainConfig(batch_size="2")`, where nothing converts: a str is not an int). A message
names the field and the flag that sets it: "batch_size must be an int, not '2' (a str)
(--batch-size)".

A field declares its rule where it is declared: its annotation (`int`, `float | None`,
`Literal["a", "b"]`), and in its metadata (`checked_field`) a `valid` range or a `normalize`
function; a class may also pass `rules` (field name -> range) where a metadata call would crowd
its fields' comments. This module imports nothing of slidetune's, so that each config module can
use it without a cycle.
"""
from __future__ import annotations

import dataclasses
import functools
import numbers
import os
import sys
import types
import typing
from dataclasses import field
from typing import Literal

TUNING_SECTION = "tuning"       # the YAML section, config.json group and flag prefix of the runtime's knobs

# flag name overrides (field path -> flag, without the dashes); None hides a field (it follows another)
FLAG_NAMES = {"data.path": "data", "data.seed": None, "data.eval_path": "eval-data", "data.split": "data-split",
              "data.subset": "data-subset", "data.columns": "data-columns", "data.streaming": "data-streaming", "data.cache_dir": "data-cache-dir"}


class FieldTypeError(TypeError, ValueError):
    """A field given a value of the wrong type. A TypeError for Python code that passed it; a
    ValueError too, so that the command line's clean errors and config_from_args' check of which
    input a refusal came from treat it as every other refused value."""


def checked_field(default, *, valid=None, normalize=None, **metadata):
    """A field with a range or a normalizer. `valid`: (predicate, rule) for a range (the message
    says "NAME must be RULE"); `normalize`: a function of (value, name) that maps other spellings
    to the canonical value (and refuses the rest)."""
    return field(default=default, metadata={"valid": valid, "normalize": normalize, **metadata})


def _words(values) -> str:
    """("a", "b", "c") -> "a, b or c"."""
    values = [str(v) for v in values]
    return values[0] if len(values) == 1 else ", ".join(values[:-1]) + " or " + values[-1]


def resolve_type(tp):
    """An annotation as a type: `from __future__ import annotations` leaves strings."""
    if isinstance(tp, str):
        tp = eval(tp, {**vars(typing), "Literal": Literal})  # noqa: S307 - our own annotations
    return tp


def base_type(tp):
    """int | None -> (int, True); Literal["a", "b"] -> (str, False)."""
    tp = resolve_type(tp)
    args = typing.get_args(tp)
    if typing.get_origin(tp) is Literal:
        return type(args[0]), False
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        non_none = [a for a in args if a is not type(None)]
        return non_none[0], True
    return tp, False


def literal_choices(tp) -> tuple | None:
    """A `Literal[...]` type's values (argparse's choices), None for any other type."""
    tp = resolve_type(tp)
    return typing.get_args(tp) if typing.get_origin(tp) is Literal else None


@dataclasses.dataclass(frozen=True)
class _Spec:
    """What check_fields needs of one field, worked out once per class (replace() runs it often:
    the fit's and the limits' searches build thousands of RuntimeConfigs)."""
    field: dataclasses.Field
    base: type
    optional: bool
    choices: tuple | None


@functools.cache
def _specs(cls) -> tuple[_Spec, ...]:
    hints = typing.get_type_hints(cls, globalns={**vars(sys.modules[cls.__module__]), "Literal": Literal})
    return tuple(_Spec(f, *base_type(hints[f.name]), literal_choices(hints[f.name])) for f in dataclasses.fields(cls))


def flag_of(f: dataclasses.Field, section: str = "") -> str | None:
    """The command-line flag that sets a field of `section` ("" for TrainConfig's own, "data",
    "runtime", "optim"): --tuning.NAME for a tuning knob; None for a field no flag sets."""
    if TUNING_SECTION in f.metadata:
        return f"--{TUNING_SECTION}.{f.name}"
    path = f"{section}.{f.name}" if section else f.name
    name = FLAG_NAMES.get(path, f.name)
    return None if name is None else "--" + name.replace("_", "-")


def _refusal(name: str, flag: str | None, what: str, value, error=ValueError, given: str = "") -> Exception:
    """"NAME must be WHAT, not VALUE (FLAG)"; `given`: the type of a value of the wrong type."""
    given = f"the {given} " if given else ""
    return error(f"{name} must be {what}, not {given}{value!r}" + (f" ({flag})" if flag else ""))


_ARTICLES = {int: "an int", float: "a number", bool: "a bool (True or False)", str: "a str"}


def _typed(value, spec: _Spec, section: str):
    """`value` as the field's annotation takes it, or a FieldTypeError. Python's numeric tower: an
    int is a float, a bool is neither (True is not a step count); numpy's numbers become Python's
    (a config is saved as JSON); a path object is a str field's path."""
    base = spec.base
    if value is None:
        if spec.optional:
            return None
    elif base is str and isinstance(value, (str, os.PathLike)):
        return os.fspath(value)
    elif base is int and isinstance(value, numbers.Integral) and not isinstance(value, bool):
        return value if type(value) is int else int(value)
    elif base is float and isinstance(value, numbers.Real) and not isinstance(value, bool):
        return value if type(value) in (int, float) else float(value)
    elif base is bool and isinstance(value, (bool, numbers.Integral)) and value in (0, 1):
        return bool(value)
    elif base not in _ARTICLES and isinstance(value, base):     # a section: its own dataclass
        return value
    what = _ARTICLES.get(base, f"a {getattr(base, '__name__', base)}") + (" or None" if spec.optional else "")
    raise _refusal(spec.field.name, flag_of(spec.field, section), what, value, FieldTypeError,
                   given=type(value).__name__)


def check_fields(obj, section: str = "", rules: dict | None = None) -> None:
    """The one validator of the config dataclasses: each field normalized (where it declares how),
    checked against its type, its Literal choices and its range (the field's `valid`, or `rules`:
    name -> (predicate, rule)). A range is not applied to None (an optional field left unset).
    Refuses with a ValueError (FieldTypeError for a type) naming the field and its flag."""
    for spec in _specs(type(obj)):
        f = spec.field
        given = value = getattr(obj, f.name)
        if f.metadata.get("normalize"):
            try:
                value = f.metadata["normalize"](value, f.name)
            except TypeError:        # e.g. a str where the normalizer compares numbers
                value = f.metadata["normalize"](_typed(value, spec, section), f.name)
        value = _typed(value, spec, section)
        if value is not given:
            object.__setattr__(obj, f.name, value)        # frozen sections too: this is their __init__
        if spec.choices is not None and value not in spec.choices:
            raise _refusal(f.name, flag_of(f, section), _words(spec.choices), value)
        valid = f.metadata.get("valid") or (rules or {}).get(f.name)
        if valid and value is not None and not valid[0](value):
            raise _refusal(f.name, flag_of(f, section), valid[1], value)
