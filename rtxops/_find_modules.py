"""Whether modules can be imported, found without importing them: what ``RTXOPS_VARIANT_MODULES``
names is checked with it before a job starts. Imports nothing of rtxops, so that a job's own
interpreter (another Python than rtxops's) can run this file by path:
``python _find_modules.py REQUEST_JSON`` prints one JSON list of ``[name, problem]``."""
import os
import sys

if __name__ == "__main__":   # this file's folder (rtxops's own modules) is not on the job's path
    _here = os.path.dirname(os.path.realpath(__file__))
    if sys.path and os.path.realpath(sys.path[0] or ".") == _here:   # (absent under -P)
        del sys.path[0]

import importlib.util  # noqa: E402
import json  # noqa: E402


def problems(names, search_first, package_root=None):
    """``[name, problem]`` for each name that cannot be imported, looked for in ``search_first``
    before this interpreter's path, and in ``package_root`` after it when this interpreter has
    no rtxops of its own (as a job's runtime adds it). A dotted name's package is imported to
    find it; the module itself is not."""
    saved = sys.path[:]
    sys.path[:0] = [f for f in search_first if f not in sys.path]
    if package_root and importlib.util.find_spec("rtxops") is None:
        sys.path.append(package_root)
    found = []
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
    request = json.loads(sys.argv[1])
    print("\n" + json.dumps(problems(request["names"], request["search_first"], request["package_root"])))
