"""How every bench hands over its result: JSON on stdout, and the same text in ``--out``."""
from __future__ import annotations

import json
from pathlib import Path


def report(result: dict, out: str | Path | None) -> None:
    """Print ``result`` as JSON, and write it to the file ``out`` too when one is given."""
    text = json.dumps(result, indent=2)
    print(text)
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(text + "\n")
