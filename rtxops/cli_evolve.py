"""``rtxops tune`` and ``rtxops evolve replay|status``. Thin: parse, call :mod:`rtxops.evolve` (or
the daemon that owns the store), print. Exit codes: 0 ok, 1 failed (task, daemon), 2 bad usage or
unreadable input."""
from __future__ import annotations

import json
import os
import random
import signal
import threading
import time
from pathlib import Path
from typing import List, Optional

import typer
from rich.console import Console
from rich.table import Table

from rtxops.cli_text import HomeOpt, inert, plain

err = Console(stderr=True, emoji=False)
out = Console(highlight=False, soft_wrap=True, markup=False, emoji=False)  # names, paths as they are

evolve_app = typer.Typer(help="The evolve loop: status, and the replay simulator.",
                         no_args_is_help=True)
POLL_S = 0.5


def register(app: typer.Typer) -> None:
    """Add ``tune`` and ``evolve`` to the ``rtxops`` app."""
    app.command("tune")(tune)
    app.add_typer(evolve_app, name="evolve")


def _fail(message: str, code: int = 2) -> typer.Exit:
    err.print(f"rtxops: {message}", markup=False)
    return typer.Exit(code)


def _home(home: Optional[Path]):
    from rtxops.daemon.home import Home

    return Home.resolve(home)


def _daemon(home):
    from rtxops.daemon.client import DaemonClient

    return DaemonClient.find(home)


def _call(client, method: str, path: str, **kw) -> dict:
    """A daemon call; a 422 (bad input) exits 2, anything else that fails exits 1."""
    from rtxops.daemon.client import DaemonError

    try:
        return client._call(method, path, **kw)
    except DaemonError as e:
        raise _fail(str(e), 2 if str(e).startswith("422") else 1) from None


def _store_path(home) -> Path:
    return Path(os.environ.get("RTXOPS_STORE") or home.store)


# ---- tune --------------------------------------------------------------------------------------
def tune(
    op: Optional[str] = typer.Option(None, help="only this op (default: every recorded op)"),
    bucket: Optional[str] = typer.Option(None, help="only this bucket, e.g. float32/cpu/hidden=64,rows=16"),
    strategy: str = typer.Option("successive_halving", help="exhaustive | random | successive_halving | thompson"),
    budget: int = typer.Option(12, help="trials per bucket (one trial: one arm's repetitions)"),
    reps: int = typer.Option(20, help="timed fwd+bwd repetitions per trial"),
    warmup: int = typer.Option(3, help="untimed calls per arm before timing"),
    variant: Optional[List[str]] = typer.Option(None, "--variant", help="only these variants (repeatable)"),
    seed: Optional[int] = typer.Option(None, help="the strategy's seed (default: a fresh one, "
                                       "given in the report): which arms a small budget tries"),
    sweep_out: Optional[Path] = typer.Option(None, help="write every measured arm's values (replay format)"),
    show: bool = typer.Option(False, "--show", help="print the tuning database instead of tuning"),
    as_json: bool = typer.Option(False, "--json", help="JSON instead of tables"),
    home: Optional[Path] = HomeOpt,
) -> None:
    """Benchmark candidate variants on the recorded buckets in worker processes and store the
    results in the tuning database; through the running daemon, or in-process when none runs."""
    from rtxops.evolve.search import STRATEGIES
    from rtxops.evolve.stats import MIN_SAMPLES

    h = _home(home)
    if show:
        rows = _tuning_rows(h, op, _bucket_as_stored(op, bucket) if bucket else None)
        if variant:
            rows = [r for r in rows if r["variant"] in variant]
        rows = _with_staleness(rows)
        if as_json:
            out.print_json(data=rows)
        elif rows:
            out.print(_tuning_table(rows))
        else:
            err.print(_no_tuning_rows(op, bucket, variant), markup=False, highlight=False)
        return
    if strategy not in STRATEGIES:
        raise _fail(f"unknown strategy {strategy!r} (known: {', '.join(STRATEGIES)})")
    if budget < 1 or reps < 1 or warmup < 0:
        raise _fail("--budget and --reps must be at least 1, --warmup at least 0")
    if reps < MIN_SAMPLES:
        err.print(f"rtxops: --reps {reps}: the arms are measured, but the comparison with the "
                  f"reference needs {MIN_SAMPLES} repetitions to decide anything", markup=False)
    if seed is not None and not 0 <= seed <= 2**31:
        raise _fail("--seed must be between 0 and 2**31")
    # a fixed seed tried the same few arms on every run of a small budget, never the others
    params = {"op": op, "bucket": bucket, "strategy": strategy, "budget": budget, "reps": reps,
              "warmup": warmup, "variants": list(variant) if variant else None,
              "seed": random.randrange(2**31) if seed is None else seed}
    sweep_out = sweep_out.resolve() if sweep_out is not None else None
    if sweep_out is not None and (sweep_out.is_dir() or not sweep_out.parent.is_dir()):
        raise _fail(f"--sweep-out {sweep_out}: not a file in an existing folder")  # before the trials
    client = _daemon(h)
    report = _tune_remote(client, params, as_json) if client else _tune_local(h, params, as_json, sweep_out)
    if sweep_out is not None and client:
        from rtxops.evolve.offline import write_sweeps

        report["sweep_files"] = write_sweeps(report, sweep_out)
    if as_json:
        out.print_json(data=report)
    else:
        _print_report(report)


def _tune_remote(client, params: dict, quiet: bool) -> dict:
    task = _call(client, "POST", "/v1/evolve/tune", json=params)
    try:
        with _progress(quiet) as bar:
            while task["state"] in ("queued", "running"):
                time.sleep(POLL_S)
                task = _call(client, "GET", f"/v1/evolve/tune/{task['id']}")
                bar(task.get("progress") or {})
    except KeyboardInterrupt:  # the task runs in the daemon: stop it there too
        state = _call(client, "POST", f"/v1/evolve/tune/{task['id']}/cancel").get("state")
        if state in ("queued", "running", "cancelled"):
            err.print(f"rtxops: cancelled tuning task {task['id']} (it stops once the benchmark "
                      "running now ends; its trials so far are kept)")
        else:
            err.print(f"rtxops: tuning task {task['id']} had already ended ({state})")
        raise typer.Exit(130) from None
    if task["state"] == "cancelled":
        raise _fail(f"tuning task {task['id']} was cancelled", 1)
    if task["state"] != "done":
        raise _fail(f"tuning task {task['id']} failed: {task.get('error')}", 1)
    return task["report"]


def _tune_local(h, params: dict, quiet: bool, sweep_out: Optional[Path]) -> dict:
    from rtxops.evolve.offline import TuneError
    from rtxops.evolve.offline import tune as run_tune
    from rtxops.runtime.registry import default_registry
    from rtxops.telemetry.store import Store

    try:
        store = Store(_store_path(h))
    except Exception as e:  # StoreError, OSError, DuckDB lock errors: all mean "cannot open"
        raise _fail(f"cannot open the store {_store_path(h)}: {e}", 1) from None
    stop = threading.Event()

    def interrupt(signum, frame):   # as through the daemon: the trials so far are kept
        if stop.is_set():
            raise KeyboardInterrupt
        stop.set()
        err.print("rtxops: stopping once the benchmark running now ends (Ctrl-C again to stop at "
                  "once); the trials so far go into the tuning database", markup=False)

    before = signal.signal(signal.SIGINT, interrupt)
    try:
        with _progress(quiet) as bar:
            report = run_tune(store, default_registry(), **params, on_progress=bar,
                              sweep_out=sweep_out, stop=stop)
    except TuneError as e:
        raise _fail(str(e), 2) from None
    finally:
        signal.signal(signal.SIGINT, before)
        store.close()
    if stop.is_set():
        out.print_json(data=report) if quiet else _print_report(report)
        raise _fail("tuning cancelled; its trials so far are in the tuning database", 130)
    return report


class _progress:
    """A rich progress bar fed with the tuner's progress events (nothing with ``quiet``)."""

    def __init__(self, quiet: bool) -> None:
        self.quiet = quiet

    def __enter__(self):
        if self.quiet:
            return lambda p: None
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

        self.bar = Progress(TextColumn("{task.description}"), BarColumn(),
                            TextColumn("{task.fields[trials]}"), TimeElapsedColumn(), console=err)
        self.bar.start()
        self.task = self.bar.add_task("tuning", total=1.0, trials="")
        return self.update

    def update(self, p: dict) -> None:
        if not p:
            return
        budget, n = p.get("budget", 1), p.get("buckets", 1)
        running = len(p.get("running") or ()) * (p.get("run_done", 0) / max(1, p.get("run_total", 1)))
        done = p.get("trials", 0) + (running if p.get("stage") == "bench" else 0)
        if p.get("stage") == "done":
            done = budget
        self.bar.update(self.task, completed=(p.get("index", 0) + min(done, budget) / budget) / n,
                        description=f"{p.get('op')} {p.get('bucket')} ({p.get('stage')})",
                        trials=f"{p.get('trials', 0)}/{budget} trials")

    def __exit__(self, *exc) -> None:
        if not self.quiet:
            self.bar.stop()


def _print_report(report: dict) -> None:
    seed = f", seed {report['seed']}" if report.get("seed") is not None else ""
    table = Table(title=f"rtxops tune: {report['strategy']}, budget {report['budget']}, "
                        f"{report['reps']} reps{seed}")
    for col in ("op", "bucket", "trials", "gate rejected", "best", "median µs", "gain vs reference",
                "CI", "verdict"):
        table.add_column(col, overflow="fold")
    for b in report["buckets"]:
        d = b["decision"]
        best = b["best"]
        median = next((a["median_ns"] for a in b["arms"] if best and
                       (a["variant"], a["config"]) == (best["variant"], best["config"])), None)
        table.add_row(*map(plain, (b["op"], b["bucket"], str(b["trials"]), str(len(b["gate_failures"])),
                      _arm_label(best) if best else "-",
                      f"{median / 1e3:.1f}" if median else "-",
                      f"{d['gain']:+.1%}" if d["gain"] is not None else "-",
                      f"{d['ci_low']:+.1%} … {d['ci_high']:+.1%}" if d["ci_low"] is not None else "-",
                      d["reason"])))
    out.print(table)
    for b in report["buckets"]:
        for arm, reason in b["gate_failures"].items():
            err.print(f"gate rejected {b['op']} {arm} on {b['bucket']}: {reason}", markup=False,
                      style="yellow")
    for b in report.get("skipped") or ():
        err.print(f"skipped recorded {b['op']} bucket {b['bucket']}: {b['reason']}", markup=False,
                  style="yellow")
    for path in report.get("sweep_files") or ():
        err.print(f"sweep written to {path}", markup=False)
    if report.get("sweep_files") == []:
        err.print("no sweep written: no arm was measured", markup=False, style="yellow")


def _arm_label(arm: dict) -> str:
    return arm["variant"] + (f" {json.dumps(arm['config'], sort_keys=True)}" if arm["config"] else "")


TUNING_ROWS_SHOWN = 100_000


def _bucket_as_stored(op: Optional[str], bucket: str) -> str:
    """``bucket`` as the tuner stores it, its dims in the op's order (``rows=16,hidden=64`` is
    tuned as ``hidden=64,rows=16``): with ``op``, that op's form (exit 2 if it is none); without,
    the one form every op with those dims agrees on, else ``bucket`` as given."""
    from rtxops.runtime.errors import PlanError, RegistryError
    from rtxops.runtime.registry import default_registry

    registry = default_registry()
    if op is not None:
        try:
            return registry.op(op).parse_bucket(bucket).id
        except (RegistryError, PlanError) as e:
            raise _fail(str(e), 2) from None
    forms = set()
    for spec in registry.ops():
        try:
            forms.add(spec.parse_bucket(bucket).id)
        except PlanError:
            pass
    return forms.pop() if len(forms) == 1 else bucket


def _tuning_rows(h, op: Optional[str], bucket: Optional[str]) -> list[dict]:
    client = _daemon(h)
    if client is not None:   # page by page, up to as many rows as a read of the store gives
        rows: list[dict] = []
        while len(rows) < TUNING_ROWS_SHOWN:
            params = {"limit": 1000, "offset": len(rows), **({"op": op} if op else {}),
                      **({"bucket": bucket} if bucket else {})}
            page = _call(client, "GET", "/v1/evolve/tuning", params=params)["tuning"]
            rows += page
            if len(page) < 1000:
                break
        return rows[:TUNING_ROWS_SHOWN]
    from rtxops.telemetry import store_evolve
    from rtxops.telemetry.store import ReadOnlyStore, StoreError

    path = _store_path(h)
    if not path.exists():
        raise _fail(f"no store at {path}", 2)
    try:
        store = ReadOnlyStore(path)
    except StoreError as e:
        raise _fail(str(e), 1) from None
    try:
        return store_evolve.tuning_rows(store, {"bucket": bucket} if bucket else None, op=op,
                                        limit=TUNING_ROWS_SHOWN)
    finally:
        store.close()


def _with_staleness(rows: list[dict]) -> list[dict]:
    """``rows``, each with ``stale``: why it no longer applies here (another torch or triton
    version, device model or kernel source: what the loop and the tuner no longer read), or ""
    for a current one; current rows first."""
    from rtxops.evolve.candidates import Arm
    from rtxops.evolve.tuning import TuningDB
    from rtxops.runtime.registry import default_registry

    db = TuningDB(None, default_registry())
    for r in rows:
        try:  # the key a result for this arm would have here, now
            now = db.key(r["op"], r["bucket"], Arm(r["variant"], r["config"] or "{}"))
        except Exception:  # an op, bucket or variant this rtxops does not know
            r["stale"] = "unknown here"
            continue
        r["stale"] = ", ".join(name for key, name in (
            ("torch_version", "torch"), ("triton_version", "triton"), ("device", "device"),
            ("source_hash", "kernel source")) if r.get(key) != now[key])
    return sorted(rows, key=lambda r: r["stale"] != "")


def _no_tuning_rows(op: Optional[str], bucket: Optional[str], variants: Optional[List[str]]) -> str:
    """The line `tune --show` prints for no rows: which filter found none, and an op name this
    rtxops does not know (a typo) named as such."""
    from rtxops.runtime.registry import default_registry

    asked = [f"{name} {value}" for name, value in (("op", op), ("bucket", bucket)) if value]
    asked += [f"variant {v}" for v in variants or ()]
    line = "rtxops: the tuning database has no rows" + (" for " + ", ".join(asked) if asked else "")
    known = sorted(spec.name for spec in default_registry().ops())
    if op and op not in known:
        line += f" ({op!r} is not an op; known: {', '.join(known)})"
    return inert(line)


def _tuning_table(rows: list[dict]) -> Table:
    stale = sum(1 for r in rows if r["stale"])
    table = Table(title=f"rtxops tuning database ({len(rows)} rows"
                        + (f", {stale} stale: not used here" if stale else "") + ")")
    for col in ("op", "bucket", "variant", "config", "median µs", "spread", "trials", "source",
                "status", "stale", "device", "torch"):
        table.add_column(col, overflow="fold")
    for r in rows:
        table.add_row(*map(plain, (r["op"], r["bucket"], r["variant"], r["config"] if r["config"] != "{}" else "",
                      f"{r['median_ns'] / 1e3:.1f}" if r["median_ns"] is not None else "-",
                      f"{r['spread']:.1%}" if r["spread"] is not None else "-", str(r["trials"]),
                      r["source"], r["status"] + (f": {r['reason']}" if r["reason"] else ""),
                      r["stale"] or "-", r["device"], r["torch_version"])))
    return table


# ---- evolve replay / status ----------------------------------------------------------------------
MAX_REPLAY_BUDGET = 100_000   # trials per run: past it a replay takes hours, and says nothing more
MAX_REPLAY_SEEDS = 10_000

@evolve_app.command("replay")
def replay(
    sweep: Path = typer.Option(..., "--sweep", help="a sweep file (rtxops tune --sweep-out)"),
    strategy: Optional[List[str]] = typer.Option(None, "--strategy", help="repeatable (default: all)"),
    budget: Optional[int] = typer.Option(None, help="trials per run (default: 2 × the arms)"),
    seeds: int = typer.Option(20, help="runs per strategy, one seed each"),
    shuffle: bool = typer.Option(False, "--shuffle",
                                 help="each seed hands the arms over in its own random order"),
    trial_reps: Optional[int] = typer.Option(
        None, help="values one trial takes the median of (default: the sweep's reps, as the "
                   "tuner's trial is one benchmark of that many repetitions)"),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Run search strategies against a recorded exhaustive sweep: trials each needs to come
    within 5 % of the best arm."""
    from rtxops.evolve.replay import MAX_REPS, SweepError, load_sweep_file
    from rtxops.evolve.replay import replay as run_replay
    from rtxops.evolve.search import STRATEGIES

    unknown = [s for s in strategy or () if s not in STRATEGIES]
    if unknown:
        raise _fail(f"unknown strategy {unknown[0]!r} (known: {', '.join(STRATEGIES)})")
    if (budget is not None and budget < 1) or seeds < 1 or (trial_reps is not None and trial_reps < 1):
        raise _fail("--budget, --seeds and --trial-reps must be at least 1")
    if (budget or 0) > MAX_REPLAY_BUDGET or seeds > MAX_REPLAY_SEEDS or (trial_reps or 0) > MAX_REPS:
        raise _fail(f"--budget goes to {MAX_REPLAY_BUDGET}, --seeds to {MAX_REPLAY_SEEDS} and "
                    f"--trial-reps to {MAX_REPS}")
    try:
        recorded = load_sweep_file(sweep)
    except SweepError as e:
        raise _fail(str(e)) from None
    result = run_replay(recorded.arms, strategy or None, budget, seeds, shuffle=shuffle,
                        trial_reps=trial_reps or recorded.reps)
    if as_json:
        out.print_json(data=result)
        return
    table = Table(title=f"replay of {sweep}: {result['arms']} arms, budget {result['budget']}, "
                        f"{result['seeds']} seeds, within {result['within']:.0%} of the best"
                        f"{', arms shuffled' if shuffle else ''}")
    for col in ("strategy", "reached", "median trials", "worst trials", "median / arms"):
        table.add_column(col, justify="left" if col == "strategy" else "right")
    for name, s in result["strategies"].items():
        med = s["median_trials"]
        table.add_row(name, f"{s['reached']:.0%}", "-" if med is None else f"{med:g}",
                      "-" if s["worst_trials"] is None else str(s["worst_trials"]),
                      "-" if med is None else f"{med / result['arms']:.0%}")
    out.print(table)


@evolve_app.command("status")
def status(as_json: bool = typer.Option(False, "--json"), home: Optional[Path] = HomeOpt) -> None:
    """The evolve loop's state per job, tuning tasks and the latest decisions (needs the daemon)."""
    h = _home(home)
    client = _daemon(h)
    if client is None:
        raise _fail(f"no daemon serving {h.root} (start one with `rtxops daemon --detach`)", 1)
    state = _call(client, "GET", "/v1/evolve/status")
    state["decisions"] = _call(client, "GET", "/v1/evolve/decisions", params={"limit": 10})["decisions"]
    if as_json:
        out.print_json(data=state)
        return
    if not state["enabled"]:
        out.print("evolve loop: off (RTXOPS_EVOLVE=0)")
    else:
        out.print("evolve loop: " + ("running" if state["ready"] else
                                     "waiting for a job (it starts once a running job has "
                                     f"reported {state.get('min_steps', 'its first')} steps)")
                  + (f" (error: {state['error']})" if state.get("error") else ""))
        for job, s in state["jobs"].items():
            active = s["active"]
            out.print(f"  job {job}: " + (f"{active['op']} {active['bucket']} {active['phase']}"
                                          if active else "idle") + f", {len(s['done'])} buckets done")
    for t in state["tune_tasks"]:
        out.print(f"tune task {t['id']}: {t['state']}" + (f" ({t['error']})" if t["error"] else ""))
    out.print(_decisions_table(state["decisions"]))


def _decisions_table(decisions: list[dict]) -> Table:
    table = Table(title="latest decisions")
    for col in ("kind", "job", "op", "bucket", "candidate", "gain", "reason"):
        if col == "job":   # whole at any width (piped: 80 columns): it is what logs and cancel take
            table.add_column(col, no_wrap=True, min_width=max(
                (len(d["job_id"] or "-") for d in decisions), default=3))
        else:
            table.add_column(col, overflow="fold")
    for d in decisions:
        table.add_row(*map(plain, (d["kind"], d["job_id"] or "-", d["op"], d["bucket"],
                      (d["candidate_variant"] or "-") + (f" {d['candidate_config']}"
                                                         if d["candidate_config"] not in (None, "{}") else ""),
                      f"{d['gain']:+.1%}" if d["gain"] is not None else "-", d["reason"] or "")))
    return table
