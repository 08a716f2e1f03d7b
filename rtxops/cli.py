"""The ``rtxops`` command. Thin: parse, call a package function, print."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import List, Optional

import typer
from rich.console import Console
from rich.table import Table

app = typer.Typer(help="rtxops: a self-optimizing runtime for PyTorch training jobs.",
                  no_args_is_help=True, add_completion=False)
err = Console(stderr=True)
TELEMETRY_FACTORY = "rtxops.telemetry.job:readings_for_job"


def _store_path() -> Path:
    from rtxops.telemetry.store import default_path

    path = Path(default_path()).resolve()
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


@app.callback()
def main() -> None:
    """rtxops: a self-optimizing runtime for PyTorch training jobs."""


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def run(
    command: List[str] = typer.Argument(..., help="the command to run, after --"),
    plan: Optional[Path] = typer.Option(None, help="plan JSON to run with (default: reference)"),
    summary: bool = typer.Option(True, help="print what the runtime did when the job ends"),
    json_summary: Optional[Path] = typer.Option(None, "--json", help="also write the summary JSON here"),
    telemetry: str = typer.Option(
        "duckdb", help="where spans go: duckdb (the store in $RTXOPS_HOME), otlp (RTXOPS_DAEMON or "
                       "OTEL_EXPORTER_OTLP_*), or off"),
) -> None:
    """Run COMMAND with the runtime enabled: ``rtxops run -- python train.py ARGS``."""
    from rtxops.runtime.bootstrap import child_environment
    from rtxops.runtime.summary import per_op

    if plan is not None and not plan.is_file():
        err.print(f"[red]rtxops: plan file {plan} does not exist[/red]")
        raise typer.Exit(2)
    if telemetry not in ("duckdb", "otlp", "off"):
        err.print(f"[red]rtxops: --telemetry {telemetry!r}: expected duckdb, otlp or off[/red]")
        raise typer.Exit(2)
    with tempfile.TemporaryDirectory(prefix="rtxops-run-") as tmp:
        summary_file = Path(tmp) / "summary.json"
        env = child_environment(os.environ, plan=str(plan) if plan else None, summary=str(summary_file),
                                readings_factory=None if telemetry == "off" else TELEMETRY_FACTORY)
        env["RTXOPS_TELEMETRY"] = telemetry
        if telemetry == "duckdb":
            env.setdefault("RTXOPS_STORE", str(_store_path()))
        code = _run_child(command, env)
        data = json.loads(summary_file.read_text()) if summary_file.is_file() else None
    if data is None:
        err.print("rtxops: the job left no summary (it did not start Python, or was killed)")
    else:
        if json_summary:
            json_summary.write_text(json.dumps(data, indent=2))
        if summary:
            _print_summary(data, per_op(data))
    raise typer.Exit(code)


def _run_child(command: list[str], env: dict[str, str]) -> int:
    try:
        child = subprocess.Popen(command, env=env)
    except OSError as e:
        err.print(f"[red]rtxops: cannot start {command[0]!r}: {e.strerror}[/red]")
        return 127 if isinstance(e, FileNotFoundError) else 126

    def forward(signum, frame):
        child.send_signal(signum)

    old = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        code = child.wait()
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)
    return 128 - code if code < 0 else code


def _print_summary(data: dict, ops: list[dict]) -> None:
    table = Table(title=f"rtxops: {data['steps']} optimizer steps, plan v{data['plan_version']}")
    for col in ("op", "calls", "time ms", "share", "bucket", "variant (calls)"):
        table.add_column(col, justify="right" if col in ("calls", "time ms", "share") else "left",
                         overflow="fold")
    for o in ops:
        for i, (bucket, variants) in enumerate(sorted(o["buckets"].items())):
            used = ", ".join(f"{v} ({n})" for v, n in sorted(variants.items()))
            head = (o["op"], str(o["calls"]), f"{o['total_ns'] / 1e6:.1f}", f"{o['share']:.1%}")
            table.add_row(*(head if i == 0 else ("",) * 4), bucket, used)
    err.print(table)
    for d in data["disabled"]:
        err.print(f"[yellow]disabled {d['op']}/{d['variant']} on {d['bucket']}: {d['reason']}[/yellow]")
    for m in data["modules_on_own_forward"]:
        err.print(f"[yellow]{m['site']} kept its own forward: {m['reason']}[/yellow]")
    for r in data["plan_rejections"]:
        err.print(f"[yellow]plan rejected: {r}[/yellow]")


if __name__ == "__main__":
    app()
