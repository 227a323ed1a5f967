"""Typed configuration: one dataclass per component, the command line derived from them.

Each component defines a `@dataclass` whose fields carry their default and a one-line
docstring given as `field(metadata={"help": ...})`, and validates itself in `__post_init__`
raising `ConfigError` that names the bad field. `add_config_args` turns such a dataclass into
argparse flags (`--field-name`) and `config_from_args` builds the typed object back, so every
default is defined once, in the dataclass.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import typing
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")


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


def add_config_args(parser: argparse.ArgumentParser, cls: type, prefix: str = "") -> None:
    """Add one flag per field of dataclass `cls` (bools as --x/--no-x, lists as JSON)."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if not f.init or f.metadata.get("cli") is False:
            continue
        tp = hints[f.name]
        origin = typing.get_origin(tp)
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        base = args[0] if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)) and args else tp
        help_text = f.metadata.get("help", "").replace("%", "%%")  # argparse %-formats help strings
        default = f.default if f.default is not dataclasses.MISSING else (
            f.default_factory() if f.default_factory is not dataclasses.MISSING else None)
        dest = prefix + f.name
        if base is bool:
            parser.add_argument(_flag(prefix, f.name), dest=dest, action=argparse.BooleanOptionalAction,
                                default=argparse.SUPPRESS, help=f"{help_text} (default: {default})")
        elif base in (int, float, str, Path):
            parser.add_argument(_flag(prefix, f.name), dest=dest, type=base, default=argparse.SUPPRESS,
                                help=f"{help_text} (default: {default})")
        else:
            parser.add_argument(_flag(prefix, f.name), dest=dest, type=json.loads, default=argparse.SUPPRESS,
                                help=f"{help_text} (JSON; default: {default})")


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
