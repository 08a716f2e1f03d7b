"""Loaded by every Python process started under ``rtxops run`` (this folder leads PYTHONPATH).

Turns the runtime on before the user's script runs, then hands over to any other
``sitecustomize`` that this one shadows."""
import importlib.util
import os
import sys


def _chain_next_sitecustomize() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    for entry in sys.path:
        if not entry or os.path.abspath(entry) == here:
            continue
        package = os.path.join(entry, "sitecustomize", "__init__.py")
        for candidate in (os.path.join(entry, "sitecustomize.py"), package):
            if os.path.isfile(candidate):
                spec = importlib.util.spec_from_file_location(
                    "_rtxops_chained_sitecustomize", candidate,
                    submodule_search_locations=[os.path.dirname(candidate)] if candidate == package else None)
                module = importlib.util.module_from_spec(spec)
                spec.loader.exec_module(module)
                return


try:
    _chain_next_sitecustomize()
except Exception as err:   # the user's own sitecustomize failing: said as site says it, and
    if sys.flags.verbose:     # rtxops still starts (it was silently off)
        sys.excepthook(*sys.exc_info())
    else:
        print(f"Error in sitecustomize; set PYTHONVERBOSE for traceback:\n"
              f"{err.__class__.__name__}: {err}", file=sys.stderr)

# torchrun's launcher process runs no training: only its workers (which have LOCAL_RANK) get the runtime
_is_launcher = os.environ.get("RTXOPS_LAUNCHER") == "torchrun" and "LOCAL_RANK" not in os.environ


def _is_helper_process() -> bool:
    """A process that inherits the job's environment and never trains: the forkserver or the
    resource tracker that the job's multiprocessing starts (``python -c 'from
    multiprocessing.forkserver import main; …'``), or an Inductor compile worker (``python
    …/torch/_inductor/compile_worker/__main__.py``; a runtime there would poll the daemon and
    export under the job's rank), or max-autotune's benchmarking process. Spawned workers (``from multiprocessing.spawn import
    spawn_main``) may train, as with torch.multiprocessing.spawn: they get the runtime."""
    try:
        with open("/proc/self/cmdline", "rb") as f:
            argv = f.read().split(b"\0")
    except OSError:
        argv = [a.encode() for a in sys.argv]
    return any(a.startswith((b"from multiprocessing.forkserver", b"from multiprocessing.resource_tracker"))
               or a.replace(b"\\", b"/").endswith((b"torch/_inductor/compile_worker/__main__.py",
                                                    b"torch/_inductor/__autotune_main__.py"))
               or a == b"torch._inductor.compile_worker"
               for a in argv)


# a Python without torch (a tool the job runs with another interpreter) has nothing to route
if os.environ.get("RTXOPS_ENABLE") == "1" and not _is_launcher and not _is_helper_process() \
        and importlib.util.find_spec("torch") is not None:
    try:
        # a Python where rtxops is not installed finds it after its own packages, never before
        if os.environ.get("RTXOPS_PACKAGE_ROOT") and importlib.util.find_spec("rtxops") is None:
            sys.path.append(os.environ["RTXOPS_PACKAGE_ROOT"])
        from rtxops.runtime.bootstrap import start

        start()
    except Exception as e:  # never stop the user's program because rtxops is missing or broken
        print(f"rtxops: runtime not enabled: {type(e).__name__}: {e}", file=sys.stderr)
