"""Typed configuration: one dataclass per component, the command line derived from them.

Each component defines a `@dataclass` whose fields carry their default and a one-line
docstring given as `field(metadata={"help": ...})`, and validates itself in `__post_init__`
raising `ConfigError` that names the bad field. `add_config_args` turns such a dataclass into
argparse flags (`--field-name`), one argument group per dataclass, and `config_from_args` builds
the typed object back, so every default is defined once, in the dataclass.

`--help` shows each field's help cut to one short line (`short_help`); the whole text stays on
the flag (`action.full_help`) and goes to docs/flags.md (`flags_markdown`, written by
scripts/flag_docs.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import typing
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")

HELP_CHARS = 72  # the longest field help `--help` shows (before "(default: ...)")
METAVARS = {int: "N", float: "X", str: "S", Path: "PATH"}
FLAGS_DOC = "docs/flags.md"


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the field."""


def doc(help_text: str, default: Any = dataclasses.MISSING, **kw) -> Any:
    """A dataclass field with a default and its one-line help."""
    if callable(default) and not isinstance(default, (int, float, str, bool)) and default is not None:
        return dataclasses.field(default_factory=default, metadata={"help": help_text}, **kw)
    return dataclasses.field(default=default, metadata={"help": help_text}, **kw)


def check(cond: bool, name: str, message: str) -> None:
    """Raise ConfigError naming `name` unless `cond` holds."""
    if not cond:
        raise ConfigError(f"{name}: {message}")


def _flag(prefix: str, name: str) -> str:
    return "--" + (prefix + name).replace("_", "-")


def short_help(text: str, limit: int = HELP_CHARS) -> str:
    """`text` as one short `--help` line: parentheticals dropped, then cut at the first "; ",
    then at a ": " after the first 30 characters, then at a word with an ellipsis, each only
    while it is longer than `limit`."""
    if len(text) > limit:
        text = _drop_parentheticals(text)
    if len(text) > limit and "; " in text:
        text = text.split("; ", 1)[0]
    if len(text) > limit and ": " in text[30:]:  # a long enough statement before its explanation
        text = text[:30] + text[30:].split(": ", 1)[0]
    if len(text) > limit:
        text = text[:limit - 1].rsplit(" ", 1)[0].rstrip(",:;") + "…"
    return text


def _drop_parentheticals(text: str) -> str:
    out, depth = [], 0
    for ch in text:
        depth += ch == "("
        if depth == 0:
            out.append(ch)
        depth -= ch == ")" and depth > 0
    return re.sub(r" +([,.;:])", r"\1", re.sub(r"  +", " ", "".join(out))).strip()


def group_title(cls: type, prefix: str = "") -> str:
    """`--help` section of a config dataclass: e.g. "drift (DriftConfig, --drift-*)"."""
    name = cls.__name__.removesuffix("Config").lower() or cls.__name__
    return f"{name} ({cls.__name__}" + (f", {_flag(prefix, '')}*)" if prefix else ")")


def add_config_args(parser: argparse.ArgumentParser, cls: type, prefix: str = "") -> None:
    """Add one flag per field of dataclass `cls` (bools as --x/--no-x, lists as JSON) in an
    argument group of its own; fields that are themselves config dataclasses get no flag (their
    own group carries their fields)."""
    hints = typing.get_type_hints(cls)
    group = parser.add_argument_group(group_title(cls, prefix))
    parser.epilog = parser.epilog or f"Every flag's whole description: {FLAGS_DOC}."
    for f in dataclasses.fields(cls):
        if not f.init or f.metadata.get("cli") is False:
            continue
        tp = hints[f.name]
        origin = typing.get_origin(tp)
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        base = args[0] if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)) and args else tp
        if dataclasses.is_dataclass(base):
            continue
        full = f.metadata.get("help", "")
        short = short_help(full).replace("%", "%%")  # argparse %-formats help strings
        default = f.default if f.default is not dataclasses.MISSING else (
            f.default_factory() if f.default_factory is not dataclasses.MISSING else None)
        dest = prefix + f.name
        shown = f"{short} (default: {default if default != '' else repr(default)})"
        if base is bool:
            action = group.add_argument(_flag(prefix, f.name), dest=dest, action=argparse.BooleanOptionalAction,
                                        default=argparse.SUPPRESS, help=shown)
        elif base in METAVARS:
            action = group.add_argument(_flag(prefix, f.name), dest=dest, type=base, default=argparse.SUPPRESS,
                                        metavar=METAVARS[base], help=shown)
        else:
            kind = typing.get_origin(base) or base
            action = group.add_argument(_flag(prefix, f.name), dest=dest, default=argparse.SUPPRESS, metavar="JSON",
                                        type=_json_of(kind if kind in (list, dict) else None), help=shown)
        action.full_help, action.doc_default = full, default


def _json_of(kind: type | None):
    """The flag type of a JSON-valued field: parses the text and, for a list or dict field, refuses
    any other JSON value with an error that shows the form (`--batch-sizes 16` for `[16]`)."""
    def parse(text: str):
        value = json.loads(text)  # a ValueError: argparse says "invalid JSON value"
        if kind is not None and not isinstance(value, kind):
            example = "[1, 4]" if kind is list else '{"key": 1}'
            raise argparse.ArgumentTypeError(f"must be a JSON {kind.__name__} such as {example}, got {text!r}")
        return value
    parse.__name__ = "JSON"
    return parse


def flags_markdown(parser: argparse.ArgumentParser) -> str:
    """Every flag of `parser` with its default and whole help, a table per argument group."""
    out = []
    for group in parser._action_groups:  # argparse keeps its groups here; there is no public accessor
        actions = [a for a in group._group_actions if a.option_strings and a.help != argparse.SUPPRESS
                   and "-h" not in a.option_strings]
        if not actions:
            continue
        out += ["", f"### {group.title}", "", "| flag | default | meaning |", "|---|---|---|"]
        for a in actions:
            text = getattr(a, "full_help", None) or (a.help or "").replace("%%", "%")
            default = getattr(a, "doc_default", a.default)
            default = "" if default in (None, argparse.SUPPRESS) else f"`{default if default != '' else repr('')}`"
            flag = " / ".join(f"`{o}`" for o in a.option_strings)
            text = text.replace("|", "\\|")  # a table cell
            out.append(f"| {flag} | {default} | {text} |")
    return "\n".join(out).lstrip("\n") + "\n"


def config_from_args(cls: type[T], ns: argparse.Namespace, prefix: str = "", **overrides) -> T:
    """Build `cls` from the flags `add_config_args` added; unset flags keep the dataclass default."""
    kwargs = {}
    for f in dataclasses.fields(cls):
        if hasattr(ns, prefix + f.name):
            kwargs[f.name] = getattr(ns, prefix + f.name)
    kwargs.update(overrides)
    return cls(**kwargs)


def config_to_dict(cfg: Any) -> dict:
    """JSON-safe dict of a config dataclass (Paths as strings)."""
    out = {}
    for f in dataclasses.fields(cfg):
        v = getattr(cfg, f.name)
        if dataclasses.is_dataclass(v):
            v = config_to_dict(v)
        elif isinstance(v, Path):
            v = str(v)
        out[f.name] = v
    return out
