"""The evolve loop: from a running job's telemetry to better plans, one hot bucket at a time.

Per job, a bucket goes through::

    hot spot → gate candidates → explore rounds (a strategy picks arms; each round is a plan whose
    entry routes a bounded share of the bucket's calls to them) → decision (paired comparison with
    the incumbent over the same steps) → promote (a new plan) → canary → settled (drift watch)
                                                                  ↘ rollback (a newer plan with
                                                                    the old entry)

Every step reads the store (kernel spans) and publishes through the plan board; every trial,
decision, canary result and rollback is stored with its evidence.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import statistics
import threading
import time
import uuid
from concurrent import futures
from dataclasses import dataclass, field
from typing import Callable

from rtxops.runtime.bucket import Bucket
from rtxops.runtime.errors import PlanError, PlanNotIssued, PlanVersionConflict
from rtxops.runtime.plan import ExploreArm, Plan, PlanEntry, default_plan
from rtxops.runtime.registry import Registry
from rtxops.telemetry import store_evolve, store_ledger
from rtxops.telemetry.store import Store

from . import stats
from .candidates import Arm, candidates
from .config import LoopConfig
from .priors import tuning_priors
from .screen import screen
from .search import Strategy, make_strategy
from .trace import TrialSpans
from .tuning import TuningDB

log = logging.getLogger("rtxops.evolve")
ROUND_MAX_WINDOWS = 10  # an explore round waits at most this many windows for its arms' samples
EXPLORE_COST_STEPS = 5  # a round's steps before its cost to the job is judged
GATE_WAIT_S = 1.0       # a tick waits this long for a gate (verdicts already stored take ms)
GATE_ERRORS_KEPT = 3   # gates of one bucket that could not run before it is rejected
PUBLISH_ATTEMPTS = 3    # derivations of a plan when others publish for the job meanwhile
BACKWARD_MIN_CALLS = 3  # timed backward calls of the winner and the incumbent before they count


@dataclass
class BucketTuning:
    """Where one (job, op, bucket) stands."""

    op: str
    bucket: str
    incumbent: Arm
    strategy: Strategy | None = None
    # gating | exploring | canary | rolling_back | settled | rejected | rolled_back | failed
    phase: str = "exploring"
    arms: list[Arm] = field(default_factory=list)  # the candidates sent to the gate
    gating: futures.Future | None = None   # the gate's (passed, failed), while it runs
    round_arms: list[Arm] = field(default_factory=list)
    round_from: int | None = None  # the step the round's plan was swapped in (None: not yet)
    counted_round: tuple | None = None  # (plan version, round_from) of the round told already
    untold_trials: list = field(default_factory=list)  # that round's trials not written yet
    pending_arms: list[Arm] = field(default_factory=list)  # asked for, their plan not published
    plan_version: int = 0          # the last plan published for this bucket
    published_ns: int = 0
    effective_step: int = 0        # the step from which that plan applies
    # per round: step → per-call ns of the incumbent, and of each arm, in the round's window
    rounds: list[tuple[dict[int, float], dict[Arm, dict[int, float]]]] = field(default_factory=list)
    trial_ids: list[str] = field(default_factory=list)
    windows: list[list[int]] = field(default_factory=list)
    step_before: list[float] = field(default_factory=list)
    winner: Arm | None = None
    canary_from: int | None = None
    decision_ns: float | None = None  # the winner's per-call time when it was promoted
    drift_checked: int = 0
    drift_strikes: int = 0
    gate_failures: dict[str, str] = field(default_factory=dict)
    unwritten: list[Callable[[], None]] = field(default_factory=list)  # records a publish owes

    @property
    def pairs(self) -> dict[Arm, list[tuple[float, float]]]:
        """Per arm: (incumbent ns, arm ns) per step both ran in, the paired evidence."""
        out: dict[Arm, list[tuple[float, float]]] = {}
        for base, arms in self.rounds:
            for arm, mine in arms.items():
                out.setdefault(arm, []).extend((base[s], mine[s]) for s in sorted(mine) if s in base)
        return out

    def unpaired(self, arm: Arm) -> tuple[list[float], list[float]]:
        """The incumbent's and ``arm``'s values from the rounds ``arm`` ran in (only those
        windows: the incumbent of other rounds ran under other conditions), the evidence when
        steps seldom run both (a bucket called about once per step)."""
        incumbent: list[float] = []
        mine: list[float] = []
        for base, arms in self.rounds:
            if arms.get(arm):
                incumbent += [base[s] for s in sorted(base)]
                mine += [arms[arm][s] for s in sorted(arms[arm])]
        return incumbent, mine

    def summary(self) -> dict:
        return {"op": self.op, "bucket": self.bucket, "phase": self.phase,
                "incumbent": str(self.incumbent), "winner": str(self.winner) if self.winner else None,
                "exploring": [str(a) for a in self.round_arms] if self.phase == "exploring" else [],
                "trials": len(self.trial_ids), "gate_failures": self.gate_failures}


@dataclass
class JobEvolution:
    active: BucketTuning | None = None
    done: dict[tuple[str, str], BucketTuning] = field(default_factory=dict)
    gate_errors: dict[tuple[str, str], int] = field(default_factory=dict)   # gates that could not run
    own_plan: int | None = None   # the version of a plan the job runs that the board does not hold
    quiet_scans: int = 0          # hot-spot scans in a row that opened nothing
    next_scan_at: float = 0.0     # (the loop's clock) no hot-spot scan before this
    scanned_region: int | None = None   # the region swap step the last scan saw


class EvolveLoop:
    """Ticks over running jobs. ``board`` is the daemon's plan board (``current`` and ``promote``);
    ``running_jobs`` returns the ids of the jobs to tune."""

    clock = staticmethod(time.monotonic)   # what quiet hot-spot scans are put off by

    def __init__(self, store: Store, board, registry: Registry, running_jobs: Callable[[], list[str]],
                 config: LoopConfig | None = None,
                 unfinished_jobs: Callable[[], set[str]] | None = None,
                 current_step: Callable[[str], int | None] | None = None) -> None:
        self.store, self.board, self.registry = store, board, registry
        # the step a job has reached by now (the daemon's estimate; the store's newest step lags
        # by up to an export interval, 10 s for a settled job): where a new plan starts from
        self.current_step = current_step
        self.running_jobs = running_jobs
        # jobs whose tuning state is kept while they do not run (a restart's backoff)
        self.unfinished_jobs = unfinished_jobs
        self.config = config or LoopConfig()
        self.config.check_variants(registry)
        self.tuning = TuningDB(store, registry)
        self.trial_spans = TrialSpans(store)
        self.jobs: dict[str, JobEvolution] = {}
        self._lock = threading.Lock()  # one tick at a time
        self._gate_slots = threading.Semaphore(self.config.gates)
        self._status: dict = {}  # a snapshot for readers, replaced after every tick

    # ---- the tick ----------------------------------------------------------------------------
    def tick(self) -> None:
        with self._lock:
            running = set(self.running_jobs())
            keep = running | (self.unfinished_jobs() if self.unfinished_jobs else set())
            for job in list(self.jobs):
                if job not in keep:  # ended: a canary between two attempts goes on after it
                    self._close_ended(job, self.jobs.pop(job))
            for job in sorted(running):
                try:
                    self._tick_job(job)
                except Exception:  # one job's trouble must not stop the loop for the others
                    log.exception("evolve: tick failed for job %s", job)
            self._status = {job: {"active": s.active.summary() if s.active else None,
                                  "done": [b.summary() for b in s.done.values()],
                                  **({"own_plan": s.own_plan} if s.own_plan is not None else {})}
                            for job, s in self.jobs.items()}

    def _close_ended(self, job: str, state: JobEvolution) -> None:
        """A job that ended in a promotion's canary: the promotion gets an outcome (its canary
        cut short, with how far it got), not silence."""
        bt = state.active
        if bt is None or bt.phase != "canary":
            return
        try:
            last = store_evolve.last_step(self.store, job)
            seen = (f" {last - bt.canary_from + 1} steps into its {self.config.window_steps}-step "
                    "window" if last is not None and bt.canary_from is not None else
                    " before it swapped to the promoted plan")
            self._record(job, bt, "canary_incomplete", bt.winner, None,
                         plan_version=bt.plan_version,
                         reason=f"canary cut short: the job ended{seen}; the winner is unproven",
                         extra={"canary_window": [bt.canary_from, last]})
        except Exception:   # (the store): the job is gone either way
            log.exception("evolve: job %s: its cut-short canary could not be recorded", job)

    def status(self) -> dict:
        """Where every job's tuning stands, as of the last tick (never waits for a tick)."""
        return self._status

    def _tick_job(self, job: str) -> None:
        last = store_evolve.last_step(self.store, job)
        if last is None:
            return
        state = self.jobs.get(job)
        if state is None:
            active = self._interrupted_canary(job)
            self._drop_stale_arms(job, last)   # raising (the disk): the next tick takes it again
            state = self.jobs[job] = JobEvolution(active=active)
        if state.active is not None:
            self._advance(job, state, state.active, last)
        elif last >= self.config.min_steps and not self._runs_a_plan_of_its_own(job, state):
            self._check_drift(job, state, last)
            if state.active is None:
                if self.clock() < state.next_scan_at and self._region_swapped_since_scan(job, state):
                    state.quiet_scans, state.next_scan_at = 0, 0.0   # new ops routed: look afresh
                if self.clock() >= state.next_scan_at:
                    self._scan(job, state, last)

    def _scan(self, job: str, state: JobEvolution, last: int) -> None:
        """Open the job's hottest untuned bucket. A scan that opens none puts the next one off by
        twice the gap before it, from ``interval_s`` up to ``idle_scan_max_s``: the hot-spot
        query reads the job's whole window, every tick, and a converged job has nothing new."""
        if self._open_hot_bucket(job, state, last):
            state.quiet_scans, state.next_scan_at = 0, 0.0
            return
        state.quiet_scans += 1
        gap = min(self.config.interval_s * 2 ** min(state.quiet_scans, 30), self.config.idle_scan_max_s)
        state.next_scan_at = self.clock() + gap

    def _region_swapped_since_scan(self, job: str, state: JobEvolution) -> bool:
        """A region (the whole model, the optimizer) swapped since the last scan: the ops the job
        routes changed, and their hot spots are looked for now rather than after the back-off."""
        return store_evolve.region_swap_step(self.store, job) != state.scanned_region

    def _runs_a_plan_of_its_own(self, job: str, state: JobEvolution) -> bool:
        """The job swapped to a plan newer than the board's for it (``rtxops run --plan``, or a
        board that lost the job's plan file): the loop's plans, derived from the board's, would
        be refused as older, or, once numbered past it, would drop that plan's entries. The job
        is left to its plan, said once in the log and in the loop's status."""
        running = store_evolve.running_plan_version(self.store, job)
        board = (self.board.current(job) or default_plan()).version
        own = running if running is not None and running > board else None
        if own is not None and state.own_plan != own:
            log.warning("evolve: job %s runs plan version %s, which the plan board does not hold "
                        "(its version there: %s): not tuned; publish that plan for the job to "
                        "have it tuned on top of it", job, own, board)
        state.own_plan = own
        return own is not None

    def _advance(self, job: str, state: JobEvolution, bt: BucketTuning, last: int) -> None:
        if bt.phase not in _ACTIVE:   # decided in a tick whose records failed: they are left
            self._write_unwritten(bt)
        elif bt.phase == "gating":
            if not bt.gating.done() or self._swapped_lately(job, last):
                return
            try:
                self._gated(job, state, bt, last)
            except Exception:
                # the gate could not run (the store, a worker that would not start): no verdict;
                # a later tick opens a hot bucket afresh
                state.active = None
                raise
        else:
            self._follow_plan(job, bt, last)
        if bt.phase not in _ACTIVE:
            state.done[(bt.op, bt.bucket)] = bt
            state.active = None

    def _swapped_lately(self, job: str, last: int) -> bool:
        """The job swapped plans less than a window ago (the last bucket's rounds, a rollback):
        its exploring waits, so that the canary's step-time baseline is a whole window of the
        plan the job runs now. Taken across the swap, a slower plan's steps (a rolled-back
        winner's, a rejected round's arms) hid a winner as slow as they were."""
        swapped = store_evolve.last_swap_step(self.store, job)
        return swapped is not None and last - swapped < self.config.window_steps

    def _follow_plan(self, job: str, bt: BucketTuning, last: int) -> None:
        """Where the job stands with the bucket's last plan: a round to measure, a canary to
        judge, a rollback taken, or a plan never taken."""
        self._write_unwritten(bt)
        # windows count from the step the job actually swapped plans (its rtx.swap span), not
        # from the effective step asked for: telemetry lags the job by an export interval
        swapped = store_evolve.swap_step(self.store, job, bt.plan_version)
        if swapped is None:
            rolling_back = bt.phase == "rolling_back"
            self._check_refused(job, bt)
            waited = (time.time_ns() - bt.published_ns) / 1e9
            # silence is a refusal only once the job is past the plan's effective step (a job of
            # minute-long steps reaches it long after the timeout) and the timeout has passed
            past = last >= bt.effective_step + self.config.margin_steps
            if bt.phase in _ACTIVE and waited > self.config.swap_timeout_s and past:
                bt.phase = "failed"
                self._owe(job, bt, "refused", None, None,
                          reason=f"the job did not swap to plan {bt.plan_version} within "
                                 f"{self.config.swap_timeout_s:g} s, {last - bt.effective_step} "
                                 "steps past its effective step")
            if bt.phase == "failed" and rolling_back:
                self._owe(job, bt, "rollback_failed", bt.winner, None,
                          reason=f"the job did not take rollback plan {bt.plan_version}: "
                                 "the regressed kernel is still running")
                log.error("evolve: job %s: rollback of %s %s not taken", job, bt.op, bt.bucket)
            elif bt.phase == "failed":
                bt.unwritten.append(lambda: self._put_incumbent_back(job, bt, last))
            self._write_unwritten(bt)
        # the swap step itself closes calls made before the swap: windows start after it
        elif bt.phase == "exploring":
            bt.round_from = swapped + 1
            per_arm = None
            if last >= swapped + self.config.window_steps:
                per_arm = self._round_values(job, bt, last)
                # a bucket called seldom (once per step, say) gets more windows, up to 10, until
                # each arm of the round the job runs has been measured enough to be compared
                # (a bucket with no call at all in the window is not gone yet: one called every
                # 25th step has none in a 20-step window)
                if (last >= swapped + ROUND_MAX_WINDOWS * self.config.window_steps
                        or (per_arm and not self._unmeasured(job, bt, per_arm))):
                    if self._finish_round(job, bt, last, per_arm):
                        self._next_round(job, bt, last)
                    else:
                        self._vanished(job, bt, last)
                    return
            if last >= swapped + EXPLORE_COST_STEPS:
                per_arm = per_arm if per_arm is not None else self._round_values(job, bt, last)
                costs = self._exploring_cost(job, bt, per_arm, last)
                cost = sum(costs.values()) if costs is not None else None
                if cost is not None and cost > self.config.explore_cost_cap:
                    # the costliest arms are explored no more (a strategy would ask for them
                    # again, round after round, each round paying the cap), until the rest fit
                    retired = []
                    for arm in sorted(costs, key=costs.get, reverse=True):
                        if cost <= self.config.explore_cost_cap:
                            break
                        cost -= costs[arm]
                        retired.append(arm)
                        bt.strategy.retire(arm)
                    log.warning("evolve: job %s: exploring %s %s adds %.0f%% to its steps (cap "
                                "%.0f%%): the round ends now, and %s is explored no more", job,
                                bt.op, bt.bucket, 100 * sum(costs.values()),
                                100 * self.config.explore_cost_cap, ", ".join(map(str, retired)))
                    if self._finish_round(job, bt, last, per_arm):
                        self._next_round(job, bt, last)
        elif bt.phase == "canary":
            bt.canary_from = swapped + 1
            if last >= swapped + self.config.window_steps:
                self._finish_canary(job, bt, last)
        elif bt.phase == "rolling_back":  # the job runs the rollback plan: done
            bt.phase = "rolled_back"

    def _interrupted_canary(self, job: str) -> BucketTuning | None:
        """A promotion of ``job``'s whose canary had no outcome yet (the daemon restarted during
        it): watched again, with the evidence its decision names (the rounds' windows, read back
        from the telemetry). None when there is none, or it cannot be rebuilt."""
        try:
            newest: dict[tuple[str, str], dict] = {}
            for d in store_evolve.decisions(self.store, job, limit=1000):  # newest first
                newest.setdefault((d["op"], d["bucket"]), d)
            promoted = [d for d in newest.values()
                        if d["kind"] == "promote" and d["plan_version"] is not None]
            if not promoted:
                return None
            d = max(promoted, key=lambda d: d["at_ns"])
            evidence = d["evidence"] if isinstance(d["evidence"], dict) else json.loads(d["evidence"] or "{}")
            windows = [list(w) for w in evidence.get("windows") or ()
                       if isinstance(w, (list, tuple)) and len(w) == 2]
            incumbent = Arm(d["incumbent_variant"], d["incumbent_config"] or "{}")
            winner = Arm(d["candidate_variant"], d["candidate_config"] or "{}")
            # a fresh swap timeout: the job may not have swapped before the daemon went away
            last = store_evolve.last_step(self.store, job) or 0
            bt = BucketTuning(d["op"], d["bucket"], incumbent, phase="canary", winner=winner,
                              plan_version=d["plan_version"], published_ns=time.time_ns(),
                              effective_step=last, windows=windows,
                              trial_ids=list(evidence.get("trial_ids") or ()))
            if windows:
                base: dict[int, float] = {}
                mine: dict[int, float] = {}
                for r in store_evolve.arm_steps(self.store, job, bt.op, bt.bucket, windows[0][0]):
                    if any(a <= r["step"] <= b for a, b in windows):
                        arm = Arm(r["variant"], r["config"] or "{}")
                        if arm in (incumbent, winner):
                            (base if arm == incumbent else mine)[r["step"]] = r["total_ns"] / r["calls"]
                bt.rounds = [(base, {winner: mine})]
                bt.decision_ns = statistics.median(mine.values()) if mine else None
                first = windows[0][0]
                bt.step_before = [r["duration_ns"] for r in store_evolve.step_durations(
                    self.store, job, max(0, first - self.config.window_steps), first)]
        except Exception:  # the loop goes on without it, as before the restart it would not
            log.exception("evolve: job %s: the interrupted canary could not be rebuilt", job)
            return None
        log.info("evolve: job %s: watching the canary of %s %s again (plan %d)", job, bt.op,
                 bt.bucket, bt.plan_version)
        return bt

    # ---- opening a bucket ----------------------------------------------------------------------
    def _open_hot_bucket(self, job: str, state: JobEvolution, last: int) -> bool:
        """Whether a bucket was opened (perhaps decided at once)."""
        since = max(0, last - self.config.hot_window_steps)
        region = state.scanned_region = store_evolve.region_swap_step(self.store, job)
        if region is not None:
            since = max(since, region + 1)
        for hs in store_evolve.hotspots(self.store, job, since):
            if (hs["share"] or 0) < self.config.min_share:
                break
            if (hs["op"], hs["bucket"]) in state.done:
                continue
            bt = self._open(job, state, hs, last)
            if bt is not None:
                state.active = bt
                if bt.phase not in _ACTIVE:
                    state.done[(bt.op, bt.bucket)] = bt
                    state.active = None
                return True
        return False

    def _open(self, job: str, state: JobEvolution, hs: dict, last: int) -> BucketTuning | None:
        op, bucket = hs["op"], hs["bucket"]
        try:
            spec_bucket = Bucket.parse(op, bucket)
            self.registry.op(op)
            incumbent = Arm(hs["variant"], hs["config"] or "{}")
            if not isinstance(incumbent.config, dict):
                raise ValueError("a config is a JSON object")
        except Exception:
            # telemetry for an op this daemon does not know (another rtxops version), or a
            # config no runtime wrote (any OTLP client writes spans)
            return None
        bt = BucketTuning(op, bucket, incumbent, phase="gating")
        arms = [a for a in candidates(self.registry, op, spec_bucket,
                                      deterministic=self.config.deterministic) if a != incumbent]
        allowed = self.config.allowed_variants()
        resource = store_evolve.job_resource(self.store, job)
        disabled = store_evolve.disabled_arms(self.store, job, op, bucket)
        arms = [a for a in arms if (not allowed or a.variant in allowed)
                and (a.variant, a.config_json) not in disabled
                and not self._regressed(op, bucket, a, resource)]
        bt.arms = arms
        log.info("evolve: job %s: gating %d candidates of %s %s (share %.1f%%)", job, len(arms),
                 op, bucket, 100 * (hs["share"] or 0))
        # the gate runs kernels in worker processes (a compile may take minutes): off the loop's
        # thread, so the other jobs' canaries and rollbacks do not wait for it
        bt.gating = _in_background(
            lambda: screen(self.tuning, op, bucket, arms, self.config.gate_timeout_s,
                           worker_slot=self._gate_slots),   # waiting there: phase "gating"
            name=f"rtxops-gate-{op}")
        futures.wait([bt.gating], timeout=GATE_WAIT_S)   # verdicts all known: at once
        if bt.gating.done() and not self._swapped_lately(job, last):
            self._gated(job, state, bt, last)
        return bt

    def _gated(self, job: str, state: JobEvolution, bt: BucketTuning, last: int) -> None:
        """The gate has answered: explore the arms that passed, or reject the bucket. A gate
        that could not run raises (a later tick opens the bucket again), up to
        :data:`GATE_ERRORS_KEPT` times for one bucket: then the bucket is rejected with the
        reason (it was gated afresh every tick, for good)."""
        key = (bt.op, bt.bucket)
        try:
            passed, failed = bt.gating.result()
        except Exception as e:
            bt.gating = None
            errors = state.gate_errors[key] = state.gate_errors.get(key, 0) + 1
            if errors < GATE_ERRORS_KEPT:
                raise
            bt.phase = "rejected"
            self._record(job, bt, "no_candidates", None, None,
                         reason=f"the gate could not run ({errors} times): "
                                f"{type(e).__name__}: {e}")
            return
        state.gate_errors.pop(key, None)
        bt.gating = None
        bt.gate_failures = {str(a): r for a, r in failed.items()}
        for arm, reason in failed.items():
            log.info("evolve: %s %s: %s rejected by the gate: %s", bt.op, bt.bucket, arm, reason)
        if not passed:
            bt.phase = "rejected"
            self._record(job, bt, "no_candidates", None, None,
                         reason="no candidate passed the gate" if bt.arms else "no candidates")
            return
        bt.phase = "exploring"
        bt.step_before = self._step_baseline(job, last)
        prior = (tuning_priors(self.store, self.registry, bt.op, bt.bucket, sorted(passed))
                 if self.config.strategy == "thompson" else None)
        bt.strategy = make_strategy(self.config.strategy, sorted(passed), self.config.budget,
                                    seed=self.config.seed, batch=self.config.max_arms,
                                    prior=prior or None)
        log.info("evolve: job %s: tuning %s %s (%d candidates)", job, bt.op, bt.bucket, len(passed))
        self._next_round(job, bt, last)

    def _regressed(self, op: str, bucket: str, arm: Arm, resource: dict) -> bool:
        """Whether ``arm`` was marked regressed on the machine of the job ``resource`` names."""
        row = self.tuning.lookup(op, bucket, arm, resource)
        return row is not None and row["status"] == "regressed"

    # ---- explore rounds --------------------------------------------------------------------------
    def _next_round(self, job: str, bt: BucketTuning, last: int) -> None:
        # a tick that failed publishing the round (not a refusal: the disk, the ledger) is
        # retried with the same arms: asking again would charge the budget twice
        if not bt.pending_arms and bt.strategy:
            bt.pending_arms = list(dict.fromkeys(bt.strategy.ask()))
        arms = bt.pending_arms
        if not arms:
            self._decide(job, bt, last)
            return
        weight = self.config.explore_share / len(arms)
        entry = PlanEntry(bt.op, bt.bucket, bt.incumbent.variant, bt.incumbent.config,
                          tuple(ExploreArm(a.variant, a.config, weight) for a in arms))
        published = self._publish(job, bt, entry, last, {"kind": "explore", "op": bt.op,
                                                         "bucket": bt.bucket,
                                                         "arms": [str(a) for a in arms]})
        bt.pending_arms = []
        if published is None:   # refused: the board still holds the last round's arms
            self._put_incumbent_back(job, bt, last)
            bt.phase = "failed"
            return
        bt.round_arms, bt.round_from, bt.phase = arms, None, "exploring"

    def _exploring_cost(self, job: str, bt: BucketTuning, per_arm: dict[Arm, dict[int, float]],
                        last: int) -> dict[Arm, float] | None:
        """What each of the round's arms adds to the job's step time so far, as a share of its
        median step: its calls times how much longer than the incumbent's they took, per rank.
        None before there is enough to tell."""
        base = list(per_arm.get(bt.incumbent, {}).values())
        rows = store_evolve.step_durations(self.store, job, bt.round_from, last)
        steps = [r["duration_ns"] for r in rows]
        if not base or len(steps) < EXPLORE_COST_STEPS:
            return None
        # the arms' calls are summed over every rank; a step's time is one rank's
        ranks = max(1, statistics.median(r.get("ranks") or 1 for r in rows))
        calls = lambda v: getattr(v, "calls", 1)  # noqa: E731
        incumbent = sum(v * calls(v) for v in base) / sum(calls(v) for v in base)
        step = statistics.median(steps)
        if step <= 0:
            return None
        # an arm's first step holds its build (a compile takes seconds): not what exploring it
        # costs, and it would retire a compiled arm for good on its first call
        def settled(arm: Arm) -> list:
            mine = per_arm.get(arm, {})
            return [mine[s] for s in sorted(mine)[1:]]

        return {arm: sum(v * calls(v) - incumbent * calls(v) for v in settled(arm))
                / ranks / len(steps) / step for arm in bt.round_arms}

    def _round_values(self, job: str, bt: BucketTuning, last: int) -> dict[Arm, dict[int, float]]:
        """Per arm (the incumbent too): step → its per-call time, in the round's window so far."""
        per_arm: dict[Arm, dict[int, float]] = {}
        for r in store_evolve.arm_steps(self.store, job, bt.op, bt.bucket, bt.round_from):
            if r["step"] <= last:
                per_arm.setdefault(Arm(r["variant"], r["config"] or "{}"), {})[r["step"]] = \
                    stats.StepMean(r["total_ns"], r["calls"])
        return per_arm

    def _unmeasured(self, job: str, bt: BucketTuning, per_arm: dict[Arm, dict[int, float]]) -> list[Arm]:
        """The round's arms with too few samples yet, less those the job disabled (they get
        no calls: waiting for them held the round for its longest); those are retired."""
        waiting = [a for a in bt.round_arms if len(per_arm.get(a, ())) < stats.MIN_SAMPLES]
        if waiting:
            disabled = store_evolve.disabled_arms(self.store, job, bt.op, bt.bucket)
            for arm in [a for a in waiting if (a.variant, a.config_json) in disabled]:
                waiting.remove(arm)
                if bt.strategy is not None:
                    bt.strategy.retire(arm)
        return waiting

    def _finish_round(self, job: str, bt: BucketTuning, last: int,
                      per_arm: dict[Arm, dict[int, float]]) -> bool:
        """Tell the strategy what the round measured; False when the bucket had no calls at all
        in the round's window."""
        if bt.counted_round != (bt.plan_version, bt.round_from):
            # counted in memory first, whole; a tick that fails after (a trial write, the
            # publish) retries only what is left: the steps never enter the statistics twice
            bt.counted_round = (bt.plan_version, bt.round_from)
            base = per_arm.get(bt.incumbent, {})
            bt.windows.append([bt.round_from, last])
            bt.rounds.append((base, {arm: per_arm.get(arm, {}) for arm in bt.round_arms}))
            bt.untold_trials = []
            for arm in bt.round_arms:
                mine = per_arm.get(arm, {})
                values = [mine[s] for s in sorted(mine)]
                bt.strategy.tell(arm, statistics.median(values) if values else float("inf"))
                bt.untold_trials.append((arm, values, {}))
        while bt.untold_trials:
            arm, values, progress = bt.untold_trials[0]
            self._trial(job, bt, arm, values, "online", progress)
            bt.untold_trials.pop(0)
        return bool(per_arm)

    def _put_incumbent_back(self, job: str, bt: BucketTuning, last: int) -> None:
        """The bucket's tuning failed (its plan refused, or never taken): the job's next plans
        must not carry its explore arms or an unproven winner, as they would, being derived from
        the board's current plan."""
        current = self.board.current(job)
        entry = PlanEntry(bt.op, bt.bucket, bt.incumbent.variant, bt.incumbent.config)
        mine = [e for e in (current.entries if current else []) if (e.op, e.bucket) == (bt.op, bt.bucket)]
        if mine and mine[0] != entry:
            self._publish(job, bt, entry, last, {"kind": "explore", "arms": [], "op": bt.op,
                                                 "bucket": bt.bucket})

    def _drop_stale_arms(self, job: str, last: int) -> None:
        """Explore arms on the job's plan that no tuning of this loop owns (the daemon restarted
        during a round): the job would explore them for good unless their bucket is tuned again,
        and every later plan, derived from the board's, would carry them."""
        current = self.board.current(job)
        if current is None or current is self.board.current(None):
            return   # the default plan (the user's, for every job): not a round of a loop
        for e in current.entries:
            if e.explore:
                bt = BucketTuning(e.op, e.bucket, Arm.of(e.variant, dict(e.config)), phase="rejected",
                                  plan_version=current.version)
                log.info("evolve: job %s: ending the explore round of %s %s an earlier daemon "
                         "left on its plan", job, e.op, e.bucket)
                self._publish(job, bt, PlanEntry(e.op, e.bucket, e.variant, e.config), last,
                              {"kind": "explore", "arms": [], "op": e.op, "bucket": e.bucket})

    def _vanished(self, job: str, bt: BucketTuning, last: int) -> None:
        """The bucket was not called in the round's longest window (the model's compiled region
        or changed code bypasses it): stop exploring it, put its plan entry back, and say why."""
        entry = PlanEntry(bt.op, bt.bucket, bt.incumbent.variant, bt.incumbent.config)
        self._publish(job, bt, entry, last, {"kind": "explore", "arms": [], "op": bt.op,
                                             "bucket": bt.bucket})
        bt.phase = "rejected"
        self._record(job, bt, "reject", None, None,
                     reason=f"no calls of this bucket in steps {bt.round_from}-{last}: the "
                            "job no longer runs it through rtxops (a compiled region?)")

    def _trial(self, job: str, bt: BucketTuning, arm: Arm, values: list[float], mode: str,
               progress: dict) -> None:
        """Write one trial: its row, its span, its id in the bucket's evidence, the tuning
        database. ``progress`` keeps what is done for a retry by the next tick (a trial whose
        tuning update failed was written again under a new id: two rows, and two ids in the
        signed evidence, for one measurement)."""
        if "trial" not in progress:
            progress["trial"] = self._new_trial(job, bt, arm, values, mode)
        trial = progress["trial"]
        if not progress.get("saved"):
            store_evolve.save_trial(self.store, trial)
            progress["saved"] = True
        if not progress.get("told"):
            self.trial_spans.record(trial)
            bt.trial_ids.append(trial["trial_id"])
            progress["told"] = True
        if values:   # measured in the job: keyed by its torch, triton and device
            self.tuning.record(bt.op, bt.bucket, arm, source=mode, trials=len(values),
                               median_ns=trial["median_ns"], spread=trial["spread"],
                               resource=store_evolve.job_resource(self.store, job))

    def _new_trial(self, job: str, bt: BucketTuning, arm: Arm, values: list[float], mode: str) -> dict:
        now = time.time_ns()
        return {
            "trial_id": uuid.uuid4().hex, "job_id": job, "op": bt.op, "bucket": bt.bucket,
            "variant": arm.variant, "config": arm.config_json, "mode": mode,
            "strategy": self.config.strategy, "started_ns": now, "ended_ns": now,
            "samples": len(values), "status": "ok" if values else "no_samples",
            "median_ns": statistics.median(values) if values else None,
            "p95_ns": sorted(values)[int(0.95 * (len(values) - 1))] if values else None,
            "spread": _cv(values),
            "detail": {"window": bt.windows[-1] if bt.windows else None,
                       "incumbent": str(bt.incumbent)},
        }

    # ---- decision ------------------------------------------------------------------------------
    def _decide(self, job: str, bt: BucketTuning, last: int) -> None:
        best = bt.strategy.best() if bt.strategy else None
        pairs = bt.pairs.get(best, []) if best is not None else []
        # by call-weighted means (stats.compare_per_call: the arms take different numbers of
        # calls a step), over the steps both ran in; a bucket called about once per step seldom
        # runs both in one step: then over the windows the arm ran in
        if len(pairs) >= stats.MIN_PAIRED_SAMPLES or best is None:
            before, measured = [i for i, _ in pairs], [c for _, c in pairs]
        else:
            before, measured = bt.unpaired(best)
        cmp = stats.compare_per_call(before, measured, min_gain=self.config.min_gain)
        veto, unchecked = (self._backward_veto(job, bt, best, last) if best is not None and cmp.promote
                           else (None, None))
        if best is None or not cmp.promote or veto:
            entry = PlanEntry(bt.op, bt.bucket, bt.incumbent.variant, bt.incumbent.config)
            self._publish(job, bt, entry, last, {"kind": "explore", "arms": [], "op": bt.op,
                                                 "bucket": bt.bucket})
            bt.phase = "rejected"
            if veto:
                reason = veto
            elif not any(mine for _, arms in bt.rounds for mine in arms.values()):
                # (the incumbent ran: the bucket is not gone; no call took an arm)
                reason = (f"no call ran an explore arm in {len(bt.rounds)} rounds (calls inside "
                          "activation checkpointing or other saved-tensor hooks keep the main "
                          "arm): nothing to compare")
            else:
                reason = cmp.reason if best is not None else "nothing measured"
            self._record(job, bt, "reject", best, cmp, reason=reason)
            return
        # the canary compares with the steps just before this swap: the baseline taken before
        # the rounds may be many windows old, and whatever slowed the job since (longer
        # sequences, a slower data loader) would read as the winner's regression
        recent = self._step_baseline(job, last)
        if len(recent) >= stats.MIN_SAMPLES:
            bt.step_before = recent
        decision = self._decision(bt, "promote", best, cmp)
        published = self._publish(job, bt, PlanEntry(bt.op, bt.bucket, best.variant, best.config),
                                  last, decision, self._evidence(job, bt))
        if published is None:   # refused (a policy): the job must not go on exploring
            self._put_incumbent_back(job, bt, last)
            bt.phase = "failed"
            return
        bt.winner, bt.phase, bt.canary_from = best, "canary", None
        bt.decision_ns = statistics.median(measured)
        # a restarted daemon finds the canary to finish by this record: retried until written
        self._record(job, bt, "promote", best, cmp, plan_version=published.version,
                     reason=cmp.reason + (f"; {unchecked}" if unchecked else ""))

    def _step_baseline(self, job: str, last: int) -> list[float]:
        """The canary's step-time baseline: the last window's step times of the plan the job runs
        now (see _swapped_lately)."""
        swapped = store_evolve.last_swap_step(self.store, job)
        since = max(0, last - self.config.window_steps, swapped + 1 if swapped is not None else 0)
        return [r["duration_ns"] for r in store_evolve.step_durations(self.store, job, since, last)]

    def _backward_veto(self, job: str, bt: BucketTuning, best: Arm,
                       last: int) -> tuple[str | None, str | None]:
        """``(veto, unchecked)``. ``veto``: why ``best``, faster in its forward calls, must not
        win: its sampled backward calls (the runtime times one per route every few steps) make
        its forward + backward per call no faster than the incumbent's. ``unchecked``: why that
        could not be told (too few backward calls timed: inference, a short tuning, or CUDA
        routes, whose backward the runtime does not time yet), said on the promotion. Each
        figure is the median over steps of the arm's mean a call: one cold call (a kernel built
        inside its timed call) moves a mean over the whole tuning, not that."""
        since = bt.windows[0][0] if bt.windows else 0
        per_step: dict[tuple[Arm, str], list[tuple[float, int]]] = {}
        for phase in ("fwd", "bwd"):
            for r in store_evolve.arm_steps(self.store, job, bt.op, bt.bucket, since, phase):
                if r["step"] <= last:
                    per_step.setdefault((Arm(r["variant"], r["config"] or "{}"), phase), []).append(
                        (r["total_ns"] / r["calls"], r["calls"]))

        def per_call(arm: Arm, phase: str) -> tuple[float | None, int]:
            rows = per_step.get((arm, phase))
            if not rows:
                return None, 0
            return statistics.median(mean for mean, _ in rows), sum(calls for _, calls in rows)

        (fwd, _), (bwd, timed) = per_call(best, "fwd"), per_call(best, "bwd")
        (fwd_inc, _), (bwd_inc, timed_inc) = per_call(bt.incumbent, "fwd"), per_call(bt.incumbent, "bwd")
        if None in (fwd, bwd, fwd_inc, bwd_inc) or min(timed, timed_inc) < BACKWARD_MIN_CALLS:
            cuda = bt.bucket.split("/")[1:2] == ["cuda"]
            return None, (f"backward not compared ({timed} and {timed_inc} backward calls timed, "
                          f"{BACKWARD_MIN_CALLS} needed"
                          + ("; CUDA routes' backward is not timed yet" if cuda else "") + ")")
        if fwd_inc <= 0 or fwd_inc + bwd_inc <= 0:   # zero-time spans (some client's): no ratio
            return None, "backward not compared (zero-time spans)"
        if fwd + bwd < fwd_inc + bwd_inc:
            return None, None
        return (f"forward {fwd / fwd_inc - 1:+.0%} a call, but forward + backward "
                f"{(fwd + bwd) / (fwd_inc + bwd_inc) - 1:+.0%} ({timed} and {timed_inc} backward "
                "calls timed): its backward costs more than its forward saves"), None

    def _finish_canary(self, job: str, bt: BucketTuning, last: int) -> None:
        rows = store_evolve.arm_steps(self.store, job, bt.op, bt.bucket, bt.canary_from)
        live = [r["total_ns"] / r["calls"] for r in rows
                if Arm(r["variant"], r["config"] or "{}") == bt.winner and r["step"] <= last]
        steps_after = [r["duration_ns"] for r in store_evolve.step_durations(
            self.store, job, bt.canary_from, last)]
        step = stats.compare_independent(bt.step_before, steps_after, min_gain=0.0,
                                         seed=self.config.seed)
        step_regressed = step.samples >= stats.MIN_SAMPLES and step.ci_high < 0 and \
            step.gain < -self.config.step_rollback_threshold
        unproven = len(live) < stats.MIN_SAMPLES
        if (unproven and not step_regressed
                and last < bt.canary_from + ROUND_MAX_WINDOWS * self.config.window_steps):
            return  # a seldom-called bucket (or a job that took the winner off): more windows
        before = [i for i, _ in bt.pairs.get(bt.winner, [])]
        if len(before) < stats.MIN_SAMPLES:
            before = bt.unpaired(bt.winner)[0]  # promoted on unpaired evidence
        kernel = stats.compare_independent(before, live, min_gain=0.0, seed=self.config.seed)
        kernel_regressed = kernel.samples >= stats.MIN_SAMPLES and kernel.ci_high < 0 and \
            kernel.gain < -self.config.rollback_threshold
        evidence = {"canary_window": [bt.canary_from, last], "kernel": kernel.to_dict(),
                    "step": step.to_dict(), "live_samples": len(live)}
        if not (kernel_regressed or step_regressed or unproven):
            bt.phase = "settled"
            if live:
                bt.decision_ns = statistics.median(live)
            self._record(job, bt, "canary_pass", bt.winner, kernel,
                         reason="no regression in the canary window", extra=evidence)
            return
        # the reason and the figures recorded are those of the comparison that regressed
        what, cmp, threshold = (("kernel", kernel, self.config.rollback_threshold) if kernel_regressed
                                else ("step", step, self.config.step_rollback_threshold))
        if kernel_regressed or step_regressed:
            reason = (f"canary: {what} time {-cmp.gain:+.1%} against the window before the swap "
                      f"(threshold {threshold:.0%})")
        else:
            # a pass needs the winner seen running: the job may have disabled it
            cmp = kernel
            reason = (f"canary: the winner ran in {len(live)} steps of steps {bt.canary_from}-"
                      f"{last} (fewer than {stats.MIN_SAMPLES}): nothing shows it works live")
        entry = PlanEntry(bt.op, bt.bucket, bt.incumbent.variant, bt.incumbent.config)
        decision = {**self._decision(bt, "rollback", bt.winner, cmp), "reason": reason}
        published = self._publish(job, bt, entry, last, decision,
                                  {**self._evidence(job, bt), **evidence})
        if published is None:  # refused: say so; the regressed kernel is still running
            bt.phase = "failed"
            self._record(job, bt, "rollback_failed", bt.winner, cmp,
                         reason=f"{reason}; the rollback plan was refused, NOT applied",
                         extra=evidence)
            log.error("evolve: job %s: rollback of %s %s refused", job, bt.op, bt.bucket)
            return
        # published: from here on the bucket is rolling back, whatever the writes below do (a
        # tick that failed after the publish watched the rollback plan as the promotion's canary)
        bt.phase = "rolling_back"
        bt.unwritten.append(lambda: self._decide_record(
            job, bt, "rollback", bt.winner, cmp, reason=reason, plan_version=published.version,
            extra=evidence))
        if kernel_regressed:
            # the kernel itself measured slower live: kept from this bucket in every job until
            # a key part changes. A slower step alone rolls back, but is not evidence against
            # the kernel (anything in the step can have changed)
            median = statistics.median(live)
            resource = store_evolve.job_resource(self.store, job)
            bt.unwritten.append(lambda: self.tuning.record(
                bt.op, bt.bucket, bt.winner, source="canary", trials=len(live), median_ns=median,
                status="regressed", reason=reason, resource=resource))
        log.warning("evolve: job %s: rolled back %s %s: %s", job, bt.op, bt.bucket, reason)
        self._write_unwritten(bt)

    def _owe(self, job: str, bt: BucketTuning, *args, **kwargs) -> None:
        """Queue a decision record the bucket's phase already reflects (written, in order, by
        :meth:`_write_unwritten`; one that fails is retried by the next tick)."""
        bt.unwritten.append(lambda: self._decide_record(job, bt, *args, **kwargs))

    def _record(self, job: str, bt: BucketTuning, *args, **kwargs) -> None:
        """Record a decision the bucket's phase already reflects, after the records it still
        owes: a write that failed left the phase moved on and the record lost (a promotion
        without its record is a canary a restarted daemon cannot find)."""
        self._owe(job, bt, *args, **kwargs)
        self._write_unwritten(bt)

    def _write_unwritten(self, bt: BucketTuning) -> None:
        """The records a published plan still owes (in order; one that fails stays, with those
        after it, for the next tick)."""
        while bt.unwritten:
            bt.unwritten[0]()
            bt.unwritten.pop(0)

    # ---- drift ---------------------------------------------------------------------------------
    def _check_drift(self, job: str, state: JobEvolution, last: int) -> None:
        """Re-open a settled bucket whose promoted variant's live time (median per-step mean over
        the last window) is beyond the drift threshold from its decision-time figure in two
        checks a window apart — one noisy window is not drift."""
        for key, bt in list(state.done.items()):
            # a decision-time figure of 0 (kernel spans of zero time from some client): no ratio
            if (bt.phase != "settled" or not bt.decision_ns
                    or last < bt.drift_checked + self.config.window_steps):
                continue
            bt.drift_checked = last
            since = max(0, last - self.config.window_steps)
            live = [r["total_ns"] / r["calls"] for r in store_evolve.arm_steps(
                self.store, job, bt.op, bt.bucket, since) if Arm(r["variant"], r["config"] or "{}") == bt.winner]
            if not live or len(live) < min(stats.MIN_SAMPLES, self.config.window_steps // 2):
                # too few calls to tell (a bucket some steps skip still counts): no strike either
                # way, and the next strike is not "in a row" with an earlier one
                bt.drift_strikes = 0
                continue
            ratio = statistics.median(live) / bt.decision_ns
            if abs(ratio - 1) <= self.config.drift_threshold:
                bt.drift_strikes = 0
                continue
            bt.drift_strikes += 1
            if bt.drift_strikes >= 2:
                reason = f"live time {ratio - 1:+.0%} from the decision-time figure"
                self._decide_record(job, bt, "drift", bt.winner, None, reason=reason)
                log.info("evolve: job %s: %s %s drifted (%s): re-opened", job, bt.op, bt.bucket, reason)
                del state.done[key]  # the next tick finds it hot again and re-tunes it
                state.quiet_scans, state.next_scan_at = 0, 0.0

    # ---- plans and records -----------------------------------------------------------------------
    def _publish(self, job: str, bt: BucketTuning, entry: PlanEntry, last: int, decision: dict,
                 evidence: dict | None = None) -> Plan | None:
        error: PlanError | None = None
        for _ in range(PUBLISH_ATTEMPTS):
            current = self.board.current(job) or default_plan()
            entries = [e for e in current.entries if (e.op, e.bucket) != (entry.op, entry.bucket)]
            now = self.current_step(job) if self.current_step is not None else None
            plan = current.derive(entries=entries + [entry],
                                  effective_step=max(last, now or 0) + self.config.margin_steps)
            if plan.version <= bt.plan_version:
                # the board lost the plan the job runs (its file damaged, then a reload): the
                # job would refuse anything not newer than what it runs
                plan = dataclasses.replace(plan, version=bt.plan_version + 1)
            try:
                published = self.board.promote(plan, job, decision=decision, evidence=evidence or {})
            except PlanVersionConflict as e:
                error = e   # a plan published for the job meanwhile (by hand, say): derive from it
                continue
            except PlanNotIssued:
                raise   # not a refusal (the disk, the ledger): the next tick takes this step again
            except PlanError as e:
                error = e
            else:
                error = None
            break
        if error is not None:
            log.warning("evolve: job %s: plan for %s %s refused: %s", job, bt.op, bt.bucket, error)
            self._decide_record(job, bt, "refused", None, None, reason=str(error),
                                extra={"decision": decision})
            return None
        bt.plan_version, bt.published_ns = published.version, time.time_ns()
        bt.effective_step = published.effective_step if published.effective_step is not None else last
        return published

    def _check_refused(self, job: str, bt: BucketTuning) -> None:
        """A job that refused the bucket's plan (it reports why) ends the bucket's tuning."""
        for report in list(getattr(self.board, "reports", [])):  # a copy: HTTP threads append
            if report["job_id"] == job and report["version"] == bt.plan_version:
                bt.phase = "failed"
                self._owe(job, bt, "refused", None, None,
                          reason=f"the job refused plan {bt.plan_version}: {report['reason']}")
                return

    def _decision(self, bt: BucketTuning, kind: str, arm: Arm, cmp: stats.Comparison) -> dict:
        variant = self.registry.variant(bt.op, arm.variant)
        return {"kind": kind, "op": bt.op, "bucket": bt.bucket,
                "candidate": {"variant": arm.variant, "config": arm.config},
                "incumbent": {"variant": bt.incumbent.variant, "config": bt.incumbent.config},
                **{k: v for k, v in cmp.to_dict().items() if k in ("gain", "ci_low", "ci_high", "p_value")},
                "objective": self.config.objective,
                "deterministic": variant.deterministic}

    def _evidence(self, job: str, bt: BucketTuning) -> dict:
        pairs = {str(a): p for a, p in bt.pairs.items()}
        digest = hashlib.sha256(json.dumps(pairs, sort_keys=True).encode()).hexdigest()
        return {"job": job, "trial_ids": list(bt.trial_ids), "windows": list(bt.windows),
                "telemetry_digest": f"sha256:{digest}"}

    def _decide_record(self, job: str, bt: BucketTuning, kind: str, arm: Arm | None,
                       cmp: stats.Comparison | None, *, reason: str = "",
                       plan_version: int | None = None, extra: dict | None = None) -> None:
        finite = stats.finite
        bundle = None
        if plan_version is not None:  # the signed bundle of that plan, where governance issued one
            try:
                bundle = store_ledger.accepted_digest(self.store, job, plan_version)
            except Exception:  # a store without the ledger (governance off): no link
                bundle = None
        store_evolve.save_decision(self.store, {
            "decision_id": uuid.uuid4().hex, "job_id": job, "op": bt.op, "bucket": bt.bucket,
            "kind": kind,
            "candidate_variant": arm.variant if arm else None,
            "candidate_config": arm.config_json if arm else None,
            "incumbent_variant": bt.incumbent.variant, "incumbent_config": bt.incumbent.config_json,
            "plan_version": plan_version,
            "gain": finite(cmp.gain) if cmp else None, "ci_low": finite(cmp.ci_low) if cmp else None,
            "ci_high": finite(cmp.ci_high) if cmp else None,
            "p_value": finite(cmp.p_value) if cmp else None, "reason": reason,
            "evidence": {**self._evidence(job, bt), **(extra or {}),
                         "gate_failures": bt.gate_failures}, "bundle_digest": bundle,
            "at_ns": time.time_ns()})


_ACTIVE = ("gating", "exploring", "canary", "rolling_back")  # phases a bucket is still active in


def _cv(values: list[float]) -> float | None:
    if len(values) < 2:
        return None
    mean = statistics.fmean(values)
    return statistics.stdev(values) / mean if mean else None



def _in_background(fn: Callable[[], object], name: str) -> futures.Future:
    """``fn()`` on a daemon thread of its own (a daemon stopping does not wait for a gate)."""
    future: futures.Future = futures.Future()

    def run() -> None:
        try:
            future.set_result(fn())
        except BaseException as e:  # noqa: BLE001 - handed to whoever reads the result
            future.set_exception(e)

    threading.Thread(target=run, name=name, daemon=True).start()
    return future
