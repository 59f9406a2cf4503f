"""Reading a --config file (YAML; JSON is YAML too) safely and strictly, before its fields are read.

Safely: YAML's aliases (`*name`, a reference to an `&name` anchor, and `<<: *name` merges) are
refused, not expanded. Nine nested anchors of nine aliases each (the "billion laughs") are 200
bytes of text that expand to 9^9 values: PyYAML shares the objects, but anything that walks the
result (the message that quotes a bad value) runs out of memory, and a cap on the expanded size
would be one more limit to choose and explain. A config has no use for aliases: its fields are a
few dozen scalars in at most four sections, and the config.json a run saves never has one; so a
loaded config is never larger than its text. A document nested too deeply for the parser (PyYAML
recurses) is refused as well.

Strictly: a key given twice in one mapping is refused naming the key and both lines (YAML's
"last one wins" dropped the first value without a word); a directory is named as one.
"""
from __future__ import annotations

from pathlib import Path

import yaml


class ConfigFileError(ValueError):
    """A config file that is refused as a whole (not one of its values): the message names it."""


class _StrictLoader(yaml.SafeLoader):
    """yaml.SafeLoader without aliases and without duplicate keys (see the module's docstring)."""

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise ConfigFileError(f"line {event.start_mark.line + 1}: the YAML alias *{event.anchor} is not "
                                  f"accepted (aliases can expand a small file into billions of values): write "
                                  f"the value out where it is used")
        return super().compose_node(parent, index)

    def construct_mapping(self, node, deep=False):
        first_line: dict = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            try:
                seen = key in first_line
            except TypeError:          # an unhashable key: SafeLoader's own error says so
                continue
            line = key_node.start_mark.line + 1
            if seen:
                raise ConfigFileError(f"line {line}: the key {key!r} is given twice in one mapping (first on "
                                      f"line {first_line[key]}): keep one of the two values")
            first_line[key] = line
        return super().construct_mapping(node, deep=deep)


def _not_readable(path: Path) -> OSError | None:
    """Why `path` cannot be a config file (a directory, or nothing there), or None. A pipe is read
    like a file: `--config <(generate-config)`."""
    if path.is_dir():
        saved = path / "config.json"
        hint = f" (a run's saved config is {saved}: --config {saved})" if saved.is_file() else ""
        return IsADirectoryError(f"config file {path} is a directory, not a YAML or JSON file{hint}")
    if not path.exists():
        return FileNotFoundError(f"config file {path} does not exist")
    return None


def read_config_file(path) -> object:
    """The YAML (or JSON) document of a config file, as plain Python values (None for an empty
    file). Every refusal names the file: OSError where it cannot be read, ValueError where it is not
    UTF-8 text, not YAML, or uses an alias or a key twice."""
    path = Path(path)
    refusal = _not_readable(path)
    if refusal is not None:
        raise refusal
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"config file {path} is not UTF-8 text (byte {e.start}: {e.reason}); save it as "
                         f"UTF-8") from None
    except OSError as e:
        raise OSError(e.errno, f"config file {path} cannot be read: {e.strerror}") from None
    try:
        return yaml.load(text, Loader=_StrictLoader)     # noqa: S506 - a SafeLoader, stricter
    except ConfigFileError as e:
        raise ConfigFileError(f"config file {path}: {e}") from None
    except yaml.YAMLError as e:
        raise ValueError(f"config file {path} is not valid YAML: {e}") from None
    except RecursionError:
        raise ConfigFileError(f"config file {path} nests its values too deeply to be a config") from None
