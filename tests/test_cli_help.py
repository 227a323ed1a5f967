"""Every command's --help renders: argparse %-formats help strings, so a config field whose doc
says "5 %" once made `online-spec train --help` raise TypeError."""

import argparse

import pytest

from online_spec.cli import BENCHES, COMMANDS, _build_parser


@pytest.mark.parametrize("argv", [[name] for name in COMMANDS] + [["bench", name] for name in BENCHES],
                         ids=lambda argv: " ".join(argv))
def test_help_renders(argv):
    parser = _build_parser(argv)
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[argv[0]]
    if len(argv) > 1:
        sub = next(a for a in sub._actions if isinstance(a, argparse._SubParsersAction)).choices[argv[1]]
    text = sub.format_help()
    assert "usage:" in text and len(sub._actions) > 1
