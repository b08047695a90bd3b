"""``qcomm --help`` and each command's help read as plain text: no
reStructuredText markup of the docstrings leaks into the terminal."""

from __future__ import annotations

import argparse
import re

from qcomm.cli import build_parser

MARKUP = re.compile(r"``|:(func|class|meth|doc|attr|mod|data):`")


def _helps(parser: argparse.ArgumentParser, name: str) -> dict[str, str]:
    out = {name: parser.format_help()}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub, child in action.choices.items():
                out.update(_helps(child, f"{name} {sub}"))
    return out


def test_no_help_text_shows_markup() -> None:
    helps = _helps(build_parser(), "qcomm")
    assert set(helps) >= {"qcomm", "qcomm list", "qcomm check", "qcomm bench"}
    for name, text in helps.items():
        found = MARKUP.search(text)
        assert found is None, f"{name} --help shows {found.group(0)!r}: {text[:300]}"
