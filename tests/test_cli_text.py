"""Table cells of user text: shown as written, never acted on by the terminal."""
from __future__ import annotations

import io

from rich.console import Console
from rich.table import Table

from rtxops.cli_text import plain


def _rendered(cell: str) -> str:
    out = io.StringIO()
    table = Table()
    table.add_column("name")
    table.add_row(plain(cell))
    Console(file=out, width=200, force_terminal=False).print(table)
    return out.getvalue()


def test_markup_and_control_characters_in_a_name_are_shown_not_obeyed():
    """A job named with ESC [2J (anyone with the API token can name one) cleared the screen of
    whoever ran `rtxops jobs`; a right-to-left override turned the rest of its row around."""
    shown = _rendered("train[/red]\x1b[2J\u202eevil\x07")
    assert "\x1b" not in shown and "\u202e" not in shown and "\x07" not in shown
    assert "train[/red]\\x1b[2J\\u202eevil\\x07" in shown
    assert "é 漢字" in _rendered("é 漢字")   # other text as it is
