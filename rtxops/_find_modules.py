"""Whether modules can be imported, found without importing them: what ``RTXOPS_VARIANT_MODULES``
names is checked with it before a job starts. Imports nothing of rtxops, so that a job's own
interpreter (another Python than rtxops's) can run this file by path:
``python _find_modules.py FOLDER… -- NAME…`` prints one JSON list of ``[name, problem]``."""
from __future__ import annotations

import importlib.util
import json
import sys


def problems(names: list[str], search_first: list[str]) -> list[list[str]]:
    """``[name, problem]`` for each name that cannot be imported, looked for in ``search_first``
    before this interpreter's path. A dotted name's package is imported to find it; the module
    itself is not."""
    saved = sys.path[:]
    sys.path[:0] = [f for f in search_first if f not in sys.path]
    found: list[list[str]] = []
    try:
        for name in names:
            try:
                spec = importlib.util.find_spec(name)
            except Exception as e:   # its package is missing or fails on import, or a malformed name
                found.append([name, f"cannot be imported: {type(e).__name__}: {e}"])
                continue
            if spec is None:
                found.append([name, "missing"])
            elif spec.origin is None:   # a folder without __init__.py: nothing to hold VARIANTS
                found.append([name, "folder"])
    finally:
        sys.path[:] = saved
    return found


if __name__ == "__main__":
    sys.path.pop(0)   # this file's own folder is not the job's
    split = sys.argv.index("--")
    print(json.dumps(problems(sys.argv[split + 1:], sys.argv[1:split])))
