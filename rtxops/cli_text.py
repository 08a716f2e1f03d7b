"""Text for the CLI: its tables, and the option every command shares."""
from __future__ import annotations

import re

import typer
from rich.text import Text

HomeOpt = typer.Option(None, "--home", help="RTXOPS_HOME (default: $RTXOPS_HOME or ./.rtxops)")

# what a terminal would act on rather than show: C0 controls but tab and newline, DEL, C1, and
# the bidi overrides and isolates (a job's name could clear the screen or read backwards)
_ACTING = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")


def plain(cell):
    """A table cell of user text shown as it is: Rich markup (``[/red]``) as text, and control
    characters as escapes (``\\x1b``)."""
    if not isinstance(cell, str):
        return cell
    return Text(inert(cell))


def inert(text: str) -> str:
    """``text`` with what a terminal would act on written as escapes (``\\x1b``)."""
    return _ACTING.sub(lambda m: m.group().encode("unicode_escape").decode("ascii"), text)
