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


def test_a_json_flag_of_a_list_field_refuses_other_json_with_the_form(capsys):
    """A list field's flag takes a JSON list: a bare number (`--batch-sizes 16`) is refused by
    the parser with the form to use, never passed on to fail inside the config."""
    parser = _build_parser(["bench", "cuts"])
    with pytest.raises(SystemExit):
        parser.parse_args(["bench", "cuts", "--batch-sizes", "16"])
    assert "--batch-sizes: must be a JSON list such as [1, 4], got '16'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parser.parse_args(["bench", "cuts", "--batch-sizes", "[16"])
    assert "invalid JSON value" in capsys.readouterr().err
    assert parser.parse_args(["bench", "cuts", "--batch-sizes", "[16]"]).batch_sizes == [16]
