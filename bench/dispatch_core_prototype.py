"""What a native dispatch core would save a routed call, measured on a prototype (issue #3).

``prototypes/dispatch_core.cpp`` routes ``F.linear`` in C++: a signature of the call read from
the tensors themselves (dtype, device, requires_grad, sizes, strides; grad mode, autocast), a
table lookup, the clock, the route's function, the recorder's ``record_since``. Called, as a
real core would have to be, from a Python wrapper that keeps the checks dynamo and compile
sessions need (``is_dynamo_compiling()``, the compile flag). It is filled with the routes the
runtime's own ``F.linear`` site found, so both run the same function and record under the same
slot (checked before timing: every call recorded, outputs equal). Paired as in
``dispatch_cold.py`` (each timed call after a 24 MB write, or hot; the order alternating):
the runtime's routed call, the prototype's, torch's own ``F.linear``. Two calls: tiny tensors
without autograd (``dispatch_cold.py``'s), and an ``nn.Linear``'s parameters at the example
GPT's sizes with autograd on. The extension builds in a temporary folder first (~40 s, torch's
C++ headers). Medians of per-pair differences, µs. JSON on stdout (``--out`` writes it too).
"""
from __future__ import annotations

import os
import platform
import statistics
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F
from _report import report
from dispatch_cold import _Nowhere, arguments, paired

from rtxops.runtime import dispatcher as D
from rtxops.runtime import originals, patching
from rtxops.telemetry.job import start_job_telemetry

SOURCE = Path(__file__).parent / "prototypes" / "dispatch_core.cpp"


def build(folder: str):
    """The prototype extension, compiled into ``folder`` and imported."""
    from setuptools import Distribution
    from torch.utils.cpp_extension import BuildExtension, CppExtension

    ext = CppExtension("_dispatch_core_prototype", [str(SOURCE)], extra_compile_args=["-O2"])
    dist = Distribution({"name": "dispatch-core-prototype", "ext_modules": [ext],
                         "cmdclass": {"build_ext": BuildExtension.with_options(use_ninja=False)}})
    cmd = dist.get_command_obj("build_ext")
    cmd.build_lib, cmd.build_temp = folder, os.path.join(folder, "build")
    dist.run_command("build_ext")
    sys.path.insert(0, folder)
    import _dispatch_core_prototype
    return _dispatch_core_prototype


def through_core(core, torch_own):
    """The Python wrapper a core is called from: what dynamo and compile sessions need, then C++."""
    compiling, flag_of, traced_here, call = D._is_dynamo_compiling, D._compiler, D._traced_here, core.call

    def linear(*args):
        if compiling() or (flag_of._is_compiling_flag and traced_here()):
            return torch_own(*args)
        return call(*args)

    return linear


def check_records(d, core_linear, args, slot: int) -> None:
    """Each call through the core recorded once under the route's slot, its output torch's."""
    take = d.readings._take
    take()
    for _ in range(100):
        out = core_linear(*args)
    calls, _ = take()
    recorded = [calls[i] for i in range(0, len(calls), 3)]
    if recorded != [slot] * 100:
        raise SystemExit(f"the prototype recorded {len(recorded)} calls of 100 (slots {set(recorded)})")
    if not torch.equal(out, originals.original("linear")(*args)):
        raise SystemExit("the prototype's output differs from torch's")


def main() -> None:
    a = arguments(__doc__, 2000)
    junk = torch.empty(24 * 2**20 // 4)
    torch_own = originals.original("linear")
    torch.manual_seed(0)
    layer = torch.nn.Linear(128, 128)
    cases = {"tiny_no_grad": ((torch.randn(2, 16), torch.randn(16, 16), torch.randn(16)), False),
             "gpt_linear_autograd": ((torch.randn(8, 64, 128, requires_grad=True), layer.weight,
                                      layer.bias), True)}
    with tempfile.TemporaryDirectory(prefix="rtxops-core-") as folder:
        core = build(folder)
        d = patching.enable()
        telemetry = start_job_telemetry(d, _Nowhere())
        try:
            site = d.site_named("F.linear")
            core.setup(d.record_cell[0], F.linear, torch.nn.Parameter)
            core_linear = through_core(core, torch_own)
            for args, grad in cases.values():
                with torch.set_grad_enabled(grad):
                    for _ in range(20):
                        F.linear(*args)   # the route found, checked, its slot made
                    fn, slot, on_error = site.routes[site.op.call_key(*args)]
                    if on_error is not None or not core.insert(args, fn, slot):
                        raise SystemExit("the site's route is not one the prototype takes")
                    check_records(d, core_linear, args, slot)
            rounds = []
            for _ in range(a.rounds):
                row = {}
                for name, (args, grad) in cases.items():
                    with torch.set_grad_enabled(grad):
                        row[name] = {
                            "routed_cold_us": paired(F.linear, torch_own, args, a.pairs, junk),
                            "core_cold_us": paired(core_linear, torch_own, args, a.pairs, junk),
                            "core_minus_routed_cold_us": paired(core_linear, F.linear, args, a.pairs, junk),
                            "routed_hot_us": paired(F.linear, torch_own, args, a.pairs, None),
                            "core_hot_us": paired(core_linear, torch_own, args, a.pairs, None)}
                rounds.append(row)
        finally:
            telemetry.close()
            patching.disable()
    median = {case: {k: statistics.median(r[case][k] for r in rounds) for k in rounds[0][case]}
              for case in rounds[0]}
    report({"bench": "dispatch_core_prototype", "python": platform.python_version(),
            "cpus": os.cpu_count(), "torch": torch.__version__, "pairs": a.pairs,
            "method": "routed (the runtime's F.linear), core (the C++ prototype behind a Python "
                      "wrapper with the dynamo and compile checks) and torch's own F.linear, each "
                      "timed call after a 24 MB write (cold) or right after the last (hot); "
                      "medians of per-pair differences, the order alternating, µs",
            "median_of_rounds": median, "rounds": rounds}, a.out)


if __name__ == "__main__":
    main()
