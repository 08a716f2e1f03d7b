"""Text for the CLI's tables."""
from __future__ import annotations

from rich.text import Text


def plain(cell):
    """A table cell of user text shown as it is (Rich would read ``[/red]`` in it as markup)."""
    return Text(cell) if isinstance(cell, str) else cell
