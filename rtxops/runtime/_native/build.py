"""Build the C++ dispatch core (``rtxops/runtime/_dispatch_core*.so``) in place, against the torch
installed beside it: ``python rtxops/runtime/_native/build.py``. ``make install`` runs this after
torch and rtxops are installed (pip's isolated build has no torch to compile against). Without it
the routing runs in Python: the same routes, several µs more a call."""
from __future__ import annotations

import sys
import tempfile
from pathlib import Path

RUNTIME = Path(__file__).resolve().parent.parent


def main() -> int:
    from setuptools import Distribution
    from torch.utils.cpp_extension import BuildExtension, CppExtension

    ext = CppExtension("_dispatch_core", [str(RUNTIME / "_native" / "dispatch_core.cpp")],
                       extra_compile_args=["-O2"])
    dist = Distribution({"name": "rtxops-dispatch-core", "ext_modules": [ext],
                         "cmdclass": {"build_ext": BuildExtension.with_options(use_ninja=False)}})
    with tempfile.TemporaryDirectory(prefix="rtxops-build-") as temp:
        cmd = dist.get_command_obj("build_ext")
        cmd.build_lib, cmd.build_temp = str(RUNTIME), temp
        dist.run_command("build_ext")
    return 0


if __name__ == "__main__":
    sys.exit(main())
