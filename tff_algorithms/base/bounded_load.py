"""YAML and JSON a user wrote, parsed within bounds (issue 37): the one loader of the
pipeline config (`--config`, `--set`) and of the budget and privacy ledgers.

`yaml.safe_load` shares what an alias names, but whatever walks the value expands it:
ten nested levels of nine aliases each are 3.5e9 values, which an error message's repr
printed in full (gigabytes). It also recurses once per nesting level (RecursionError at a
few hundred, as `json.loads` does at about a thousand), and both hand Python's "Exceeds
the limit (4300) for integer string conversion" through, naming no key. Here:

- a text is at most MAX_TEXT_CHARS characters;
- containers nest at most MAX_DEPTH deep (checked while YAML is composed and, for JSON,
  by a linear scan of the raw text before it is decoded);
- with YAML aliases counted at the full size of what they name, a text holds at most
  MAX_VALUES values and MAX_VALUE_CHARS characters of scalars, refused while composing,
  before anything is expanded;
- an integer has at most MAX_INTEGER_DIGITS digits.

Every refusal is one ValueError line naming the source, the key (`train.rounds[0]`) and
what to change. docs/config.md lists the limits.
"""

from __future__ import annotations

import json
import re
import reprlib
from collections.abc import Callable
from typing import Any

import yaml

MAX_TEXT_CHARS = 1 << 20
MAX_DEPTH = 32
MAX_VALUES = 100_000
MAX_VALUE_CHARS = 1 << 20
MAX_INTEGER_DIGITS = 30
# Characters of a value an error message shows (an ellipsis marks the cut).
SHOWN_CHARS = 80

_INT_TAG = "tag:yaml.org,2002:int"

# A bounded repr: a few items of each level, a few levels; never the whole value.
_SHORT_REPR = reprlib.Repr()
_SHORT_REPR.maxlevel = 3
_SHORT_REPR.maxstring = SHOWN_CHARS
_SHORT_REPR.maxother = SHOWN_CHARS
_SHORT_REPR.maxlong = SHOWN_CHARS


def shown(value: Any) -> str:
    """`value` for one error line: a repr of bounded cost (a few items of each level, a
    few levels), escaped where not printable, at most SHOWN_CHARS characters."""
    text = _SHORT_REPR.repr(value)
    if not text.isprintable():
        text = ascii(text)[1:-1]
    return text if len(text) <= SHOWN_CHARS else text[: SHOWN_CHARS - 3] + "..."


def shown_name(name: str) -> str:
    """A key or path for one error line: as written when printable, else escaped; at
    most SHOWN_CHARS characters."""
    text = name if name.isprintable() else ascii(name)
    return text if len(text) <= SHOWN_CHARS else text[: SHOWN_CHARS - 3] + "..."


def shown_path(path: str) -> str:
    """A file path for one error line: whole (the user must find the file; the OS bounds
    its length), escaped where not printable."""
    return path if path.isprintable() else ascii(path)


def _where(source: str, path: str) -> str:
    return f"{source}: {shown_name(path)}" if path else source


def _join(path: str, label: str) -> str:
    if label.startswith("["):
        return path + label
    return f"{path}.{label}" if path else label


def _check_length(text: str, source: str) -> None:
    if len(text) > MAX_TEXT_CHARS:
        raise ValueError(
            f"{source} is longer than {MAX_TEXT_CHARS} characters; shorten it "
            "(docs/config.md, limits)"
        )


def _too_deep(source: str, path: str) -> ValueError:
    return ValueError(
        f"{_where(source, path)} nests deeper than {MAX_DEPTH} levels; flatten the value "
        "(docs/config.md, limits)"
    )


def _too_long_integer(source: str, path: str, digits: int) -> ValueError:
    return ValueError(
        f"{_where(source, path)} is an integer of {digits} digits; give at most "
        f"{MAX_INTEGER_DIGITS} (docs/config.md, limits)"
    )


def _check_size(source: str, path: str, values: int, chars: int) -> None:
    if values > MAX_VALUES or chars > MAX_VALUE_CHARS:
        raise ValueError(
            f"{_where(source, path)} holds more than "
            + (f"{MAX_VALUES} values" if values > MAX_VALUES else f"{MAX_VALUE_CHARS} characters")
            + " (YAML aliases counted at their full size); write a smaller value "
            "(docs/config.md, limits)"
        )


class _BoundedLoader(yaml.SafeLoader):
    """SafeLoader that measures every node as it is composed: nesting depth, the values
    and scalar characters it expands to (an alias: the size of the node it names, known
    before the alias is used) and integer digits, refusing at the first node over a limit."""

    def __init__(self, text: str, source: str, depth: int) -> None:
        super().__init__(text)
        self._source = source
        self._paths = [""]  # the key path of each node being composed
        self._depth = depth
        # id(node) -> (values, scalar characters) it expands to; nodes stay alive in the
        # document being composed, so their ids stay unique.
        self._sizes: dict[int, tuple[int, int]] = {}

    def compose_node(self, parent: yaml.Node | None, index: Any) -> yaml.Node:
        path = self._paths[-1]
        if parent is not None:
            if isinstance(index, int):
                path = _join(path, f"[{index}]")
            elif isinstance(index, yaml.ScalarNode):
                path = _join(path, str(index.value))
            elif index is not None:
                path = _join(path, "?")  # the value of a key that is a list or mapping
        if self.check_event(yaml.AliasEvent):
            named = self.anchors.get(self.peek_event().anchor)
            if named is not None and id(named) not in self._sizes:
                raise ValueError(
                    f"{_where(self._source, path)} contains itself through a YAML alias; "
                    "remove the alias"
                )
            node = super().compose_node(parent, index)
            _check_size(self._source, path, *self._sizes[id(node)])
            return node
        nests = self.check_event(yaml.SequenceStartEvent, yaml.MappingStartEvent)
        if nests:
            self._depth += 1
            if self._depth > MAX_DEPTH:
                raise _too_deep(self._source, path)
        self._paths.append(path)
        try:
            node = super().compose_node(parent, index)
        finally:
            self._paths.pop()
            self._depth -= nests
        self._sizes[id(node)] = self._measure(node, path)
        _check_size(self._source, path, *self._sizes[id(node)])
        return node

    def _measure(self, node: yaml.Node, path: str) -> tuple[int, int]:
        if isinstance(node, yaml.ScalarNode):
            if node.tag == _INT_TAG:
                digits = sum(c.isdigit() for c in node.value)
                if digits > MAX_INTEGER_DIGITS:
                    raise _too_long_integer(self._source, path, digits)
            return 1, len(node.value)
        if isinstance(node, yaml.MappingNode):
            children = [child for pair in node.value for child in pair]
        else:
            children = node.value
        sizes = [self._sizes[id(child)] for child in children]
        return 1 + sum(s[0] for s in sizes), sum(s[1] for s in sizes)


def load_yaml(text: str, source: str, depth: int = 0) -> Any:
    """The value of YAML `text`, within the limits. `source` names the text in errors
    ("config file my.yaml", "override train.rounds"); `depth`: the mappings the text is
    nested in (2 for the value of `train.rounds`), counted towards MAX_DEPTH."""
    _check_length(text, source)
    loader = None
    try:
        # The reader refuses control characters while it is constructed.
        loader = _BoundedLoader(text, source, depth)
        return loader.get_single_data()
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
        problem = " ".join(str(e.problem or e.context or type(e).__name__).split())
        raise ValueError(f"{source} is not valid YAML: {problem}{where}") from None
    except yaml.YAMLError as e:
        raise ValueError(f"{source} is not valid YAML: {' '.join(str(e).split())}") from None
    finally:
        if loader is not None:
            loader.dispose()


# JSON tokens that matter for nesting: strings (skipped whole, so brackets inside them do
# not count; a key is a string followed by a colon) and the structural characters.
_JSON_TOKEN = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"(\s*:)?|[\[\]{},]')


def _check_json_depth(text: str, source: str) -> None:
    """Refuses nesting over MAX_DEPTH in one linear pass, before `json.loads` recurses."""
    frames: list[list[Any]] = []  # per open container: [is_list, key or index]
    for token in _JSON_TOKEN.finditer(text):
        kind = token.group()[0]
        if kind in "[{":
            frames.append([kind == "[", 0 if kind == "[" else None])
            if len(frames) > MAX_DEPTH:
                path = ""
                for is_list, label in frames[:-1]:
                    path = _join(path, f"[{label}]" if is_list else str(label or "?"))
                raise _too_deep(source, path)
        elif kind in "]}":
            if frames:
                frames.pop()
        elif kind == ",":
            if frames and frames[-1][0]:
                frames[-1][1] += 1
        elif token.group(1) and frames and not frames[-1][0]:
            key = token.group()[: token.start(1) - token.start()]
            try:
                frames[-1][1] = json.loads(key)
            except json.JSONDecodeError:  # json.loads reports it below
                frames[-1][1] = "?"


class _LongInteger:
    """Stands for an integer of too many digits until the walk names its key."""

    def __init__(self, digits: int) -> None:
        self.digits = digits


def _bounded_int(text: str) -> int | _LongInteger:
    digits = len(text.lstrip("-"))
    return _LongInteger(digits) if digits > MAX_INTEGER_DIGITS else int(text)


def _walk_json(value: Any, source: str, path: str, bound_size: bool) -> tuple[int, int]:
    """(values, scalar characters) of decoded JSON; refuses long integers by their key."""
    if isinstance(value, _LongInteger):
        raise _too_long_integer(source, path, value.digits)
    if isinstance(value, dict):
        items = [(_join(path, str(k)), v) for k, v in value.items()]
        values, chars = 1, sum(len(k) for k in value)
    elif isinstance(value, list):
        items = [(_join(path, f"[{i}]"), v) for i, v in enumerate(value)]
        values, chars = 1, 0
    else:
        return 1, len(value) if isinstance(value, str) else 0
    for item_path, item in items:
        item_values, item_chars = _walk_json(item, source, item_path, bound_size)
        values, chars = values + item_values, chars + item_chars
        if bound_size:
            _check_size(source, item_path, values, chars)
    return values, chars


def load_json(text: str, source: str, bound_size: bool = True) -> Any:
    """The value of JSON `text`, within the limits (`bound_size=False`: depth and integer
    digits only, for files the program writes and lets grow, such as ledgers)."""
    if bound_size:
        _check_length(text, source)
    _check_json_depth(text, source)
    try:
        value = json.loads(text, parse_int=_bounded_int)
    except json.JSONDecodeError as e:
        raise ValueError(f"{source} is not valid JSON: {e}") from None
    _walk_json(value, source, "", bound_size)
    return value


def loader_for(file_name: str) -> Callable[[str, str], Any]:
    """load_json for a `.json` file name, else load_yaml."""
    return load_json if file_name.endswith(".json") else load_yaml
