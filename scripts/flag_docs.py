"""Write docs/flags.md: every flag of the commands built from config dataclasses, with its whole help.

`--help` shows each flag's help cut to one short line (online_spec/config.py, `short_help`); this
page keeps the whole text. Rerun after changing a config field's help:

    python scripts/flag_docs.py            # writes docs/flags.md
    python scripts/flag_docs.py --check    # exit 1 if docs/flags.md is not what it would write
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from online_spec.cli import _build_parser  # noqa: E402
from online_spec.config import FLAGS_DOC, flags_markdown  # noqa: E402

COMMANDS = [["serve"], ["train"], ["pretrain"], ["demo"]]


def subparser(argv: list[str]) -> argparse.ArgumentParser:
    parser = _build_parser(argv)
    for name in argv:
        parser = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[name]
    return parser


def render() -> str:
    out = ["# Flags", "",
           "Every flag of the commands whose flags come from config dataclasses, with its whole description",
           "(`--help` shows the first clause). Written by `python scripts/flag_docs.py`; do not edit by hand."]
    for argv in COMMANDS:
        out += ["", f"## `online-spec {' '.join(argv)}`", "", flags_markdown(subparser(argv)).rstrip("\n")]
    return "\n".join(out) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if the page is out of date")
    args = ap.parse_args()
    text, path = render(), REPO / FLAGS_DOC
    if args.check:
        current = path.read_text() if path.exists() else ""
        print("up to date" if current == text else f"{FLAGS_DOC} is out of date: run python scripts/flag_docs.py")
        return 0 if current == text else 1
    path.write_text(text)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
