"""Loaded by every Python process started under ``rtxops run`` (this folder leads PYTHONPATH).

Hands over to any other ``sitecustomize`` that this one shadows, then arranges for the runtime
to start as the process first imports torch (see :class:`_StartWithTorch`)."""
import contextlib
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


def _start_runtime() -> None:
    try:
        # a Python where rtxops is not installed finds it after its own packages, never before
        if os.environ.get("RTXOPS_PACKAGE_ROOT") and importlib.util.find_spec("rtxops") is None:
            sys.path.append(os.environ["RTXOPS_PACKAGE_ROOT"])
        from rtxops.runtime.bootstrap import start

        start()
    except Exception as e:  # never stop the user's program because rtxops is missing or broken
        print(f"rtxops: runtime not enabled: {type(e).__name__}: {e}", file=sys.stderr)


def _rtxops_importing() -> bool:
    """Whether an rtxops module is being imported (the runtime cannot start in the middle)."""
    return any(getattr(getattr(m, "__spec__", None), "_initializing", False)
               for name, m in list(sys.modules.items()) if name.partition(".")[0] == "rtxops")


class _StartWithTorch:
    """A meta path finder that starts the runtime once the process has imported torch: a
    process of the job that never imports it (a helper Python the job runs, a tool) pays
    nothing. When rtxops' own modules import torch (a job that imports rtxops first), the
    runtime starts as the outermost of them finishes: it cannot start half-way through them."""

    def __init__(self) -> None:
        self.torch_loaded = False

    def find_spec(self, name, path=None, target=None):
        if name != "torch" and name.partition(".")[0] != "rtxops":
            return None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None) if finder is not self else None
            spec = find(name, path, target) if find else None
            if spec is not None:
                break
        else:
            return None
        load = getattr(spec.loader, "exec_module", None)

        def exec_module(module):
            loaded = False
            try:
                load(module)
                loaded = True
            finally:
                with contextlib.suppress(AttributeError):
                    del spec.loader.exec_module   # the loader as it was (pickles, compares equal)
                # the module is whole (or failed): another thread's `import torch` (one the
                # runtime starts) need not wait for the lock this thread holds until start() returns
                spec._initializing = False
                self.torch_loaded = self.torch_loaded or (loaded and name == "torch")
                if self.torch_loaded and not _rtxops_importing():
                    self._start()

        if load is not None:
            try:   # on this loader only (a fresh one per find_spec): __loader__ stays the real one
                spec.loader.exec_module = exec_module
            except AttributeError:
                pass
        return spec

    def _start(self) -> None:
        if self in sys.meta_path:
            sys.meta_path.remove(self)
            _start_runtime()


# a Python without torch (a tool the job runs with another interpreter) has nothing to route
if os.environ.get("RTXOPS_ENABLE") == "1" and not _is_launcher and not _is_helper_process() \
        and importlib.util.find_spec("torch") is not None:
    if "torch" in sys.modules:   # (the user's own sitecustomize imported it)
        _start_runtime()
    else:
        sys.meta_path.insert(0, _StartWithTorch())
