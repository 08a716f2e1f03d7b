"""What an install that is not this checkout (a wheel) carries: every file the package reads at run
time. The dashboard's templates and assets were listed as data files under a folder named
``rtxops.dashboard`` beside the environment, not in the package: its pages failed to load."""
from __future__ import annotations

import fnmatch
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_non_python_file_the_packages_read_is_package_data():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    package_data = config["package-data"]
    needed = [p for folder in ("templates", "static")
              for p in (ROOT / "rtxops" / "dashboard" / folder).iterdir() if p.suffix != ".py"]
    assert needed
    for path in needed:
        package = ".".join(path.parent.parent.relative_to(ROOT).parts)
        relative = path.relative_to(path.parent.parent).as_posix()
        assert any(fnmatch.fnmatch(relative, pattern) for pattern in package_data.get(package, ())), path
    assert all("." not in name.split("/")[0] for name in config.get("data-files", {})), \
        "a data-files target named like a package installs beside the environment, not in it"
