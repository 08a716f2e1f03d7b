"""The daemon's side of governance: its signing key (made and trusted in ``$RTXOPS_HOME`` on first
start), the keyring, the policies, the bundles it issued and the ledger.

A plan is issued by laying out the bundle (plan + kernel sources), signing it (SBOM, provenance,
DSSE), verifying it as a job would (signature, trusted key, digests, policy), and recording the
outcome in the ledger: the decision, or the denial with the policy's reason."""
from __future__ import annotations

import shutil
import threading
from pathlib import Path

from . import _keys
from ._bundle import Signer, write_plan_bundle
from ._errors import PolicyDenied, UsageError, VerificationError
from ._kernels import plan_kernels, unlike_local
from ._layout import HEAD_KIND
from .keyring import Keyring
from .policy import load_policies
from .provenance import SCOPE
from .verify import Trust, verify

DAEMON_KINDS = ["plan", "telemetry", "ledger", "checkpoint", HEAD_KIND]
EVERY_JOB = "_default"  # the scope of a plan issued for every job (a job's own plan: its id)
# explore rounds issue a bundle every few dozen steps: per scope, the newest ones stay on disk
# (their ledger entries stay forever); promotions, rollbacks and manual plans are all kept
EXPLORE_BUNDLES_KEPT = 20


class Authority:
    def __init__(self, root: Path, store=None) -> None:
        self.root = Path(root)
        self.key_file = self.root / "keys" / "daemon.pem"
        self.keyring_file = self.root / "keyring.json"
        self.bundles = self.root / "bundles"
        self.head_file = self.root / "ledger.head"
        self.store = store
        # an entry and its head are written together: a reader holding this sees both or neither
        # (between them the chain looked cut short, a false alarm of tampering)
        self.ledger_lock = threading.Lock()
        # the keyring held from before the key is made to its trust: another process starting
        # on this home (or `rtxops keys`) waits, and neither makes a key of its own nor loses
        # the other's change. Unreadable: before any key is made
        with Keyring.editing(self.keyring_file) as keyring:
            new_key = not self.key_file.exists()
            if new_key:
                _keys.generate(self.key_file, self.key_file.with_suffix(".pub"))
            self.signer = Signer.from_key_file(self.key_file, builder="rtxops-daemon")
            if store is not None:
                from . import ledger  # the store (DuckDB, Arrow): only the daemon needs it

                # right after the key: a daemon key on disk means its ledger was started. A
                # home whose daemon key was made before starts no new ledger: its head and
                # entries were there (a wiped ledger passed for a new one, bundles deleted too)
                ledger.start(store, self.head_file, self.signer.key,
                             issued_before=not new_key or any(self.bundles.glob("*/v*")),
                             keyring=keyring)
            own = keyring.keys.get(self.signer.key_id)
            if own is None:
                keyring.trust(self.key_file.with_suffix(".pub").read_bytes(), name="rtxops daemon",
                              kinds=DAEMON_KINDS)
            elif own.revoked_at is None and (HEAD_KIND not in own.kinds or own.not_before):
                # a home from before the head kind, or from when the daemon's key was trusted
                # "not before" its first start (a clock stepped back then refused its plans)
                if HEAD_KIND not in own.kinds:
                    own.kinds.append(HEAD_KIND)
                own.not_before = 0.0
        # loaded on first use: building the CEL parser takes ~0.3 s, which `rtxops run` would
        # otherwise spend before its job starts
        self._policies: list | None = None
        self._policies_lock = threading.Lock()
        # the first bundle would otherwise pay for imports and the environment SBOM (seconds),
        # while the plan's effective step, set before signing, comes nearer
        self._warm_stop = threading.Event()
        self._warm = threading.Thread(target=_warm_signing, args=(self,),
                                      name="rtxops-governance-warm", daemon=True)
        self._warm.start()

    def close(self, timeout: float = 10.0) -> None:
        """Stop the warm-up between its stages and wait for it: an interpreter that finalizes
        while a thread imports C extensions can abort (a short ``rtxops run`` exits early)."""
        self._warm_stop.set()
        if self._warm.is_alive():
            self._warm.join(timeout)

    @property
    def policies(self) -> list:
        """The policies in force (the shipped ones; re-read by :meth:`reload`)."""
        if self._policies is None:  # loaded outside the lock: never wait on the warm-up
            loaded = load_policies()
            with self._policies_lock:
                if self._policies is None:
                    self._policies = loaded
        return self._policies

    def reload(self) -> None:
        policies = load_policies()
        with self._policies_lock:
            self._policies = policies

    def bundle_dir(self, scope: str, version: int) -> Path:
        if not SCOPE.fullmatch(scope):
            raise UsageError(f"plan scope {scope!r} is not a plain name (letters, digits, '.', '_', '-')")
        return self.bundles / scope / f"v{version}"

    def issue_plan(self, plan, scope: str, registry, *, decision: dict, evidence: dict | None = None,
                   job: dict | None = None) -> Path:
        """Build, sign, policy-check and record a bundle for ``plan``; returns its directory.
        Raises PolicyDenied (recorded in the ledger) or VerificationError."""
        kernels, sources = plan_kernels(plan, registry)
        final = self.bundle_dir(scope, plan.version)
        staging = final.with_name(final.name + ".staging")
        write_plan_bundle(staging, plan.to_json(), sources)
        digest = self.signer.sign_directory(staging, kind="plan", version=plan.version, scope=scope,
                                            decision=decision, evidence=evidence, kernels=kernels)
        report = verify(staging, Trust(keyring=Keyring.load(self.keyring_file)),
                        policies=self.policies, expected_kind="plan", job=job)
        entry = dict(scope=scope, version=plan.version, subject_digest=digest, decision=decision,
                     signer=self.signer.key_id)
        if not report.ok:
            shutil.rmtree(staging, ignore_errors=True)
            failure = report.failure
            self._record(kind="deny", reason=f"{failure.name}: {failure.message}", **entry)
            if failure.name == "policy":
                raise PolicyDenied(failure.message)
            raise VerificationError(failure.name, failure.message)
        kind = str(decision.get("kind") or "manual")
        self._record(kind=kind, **entry)
        if final.exists():
            shutil.rmtree(final)
        staging.replace(final)
        if kind == "explore":
            self._prune_explore_bundles(scope)
        return final

    def _prune_explore_bundles(self, scope: str) -> None:
        """Delete the bundles of ``scope``'s explore rounds older than the newest
        :data:`EXPLORE_BUNDLES_KEPT`."""
        if self.store is None:
            return
        rows = self.store.query(
            "SELECT DISTINCT version FROM ledger WHERE scope = ? AND kind = 'explore' "
            "ORDER BY version DESC OFFSET ?", [scope, EXPLORE_BUNDLES_KEPT])
        for row in rows:
            shutil.rmtree(self.bundle_dir(scope, row["version"]), ignore_errors=True)

    def _record(self, **entry) -> None:
        if self.store is not None:
            from . import ledger  # the store (DuckDB, Arrow): only the daemon needs it

            keyring = Keyring.load(self.keyring_file)
            with self.ledger_lock:
                ledger.append(self.store, self.head_file, head_key=self.signer.key,
                              keyring=keyring, **entry)


def bundle_files(directory: Path) -> dict[str, bytes]:
    """Every file of a bundle as ``{relative path: bytes}`` (to serve to jobs)."""
    return {p.relative_to(directory).as_posix(): p.read_bytes()
            for p in sorted(directory.rglob("*")) if p.is_file() and not p.is_symlink()}


def verify_plan_directory(directory: str | Path, keyring_file: str, job: dict,
                          running_version: int, any_scope: bool = False, registry=None) -> bytes:
    """``plan.json`` of the plan bundle at ``directory`` once it verifies as a job requires
    (signature, trusted key, digests, policy, kind plan, version newer than the running one,
    signed for this job or for every job, unless ``any_scope``, and kernels whose signed sources
    are the ones ``registry``, default the runtime's, runs); else VerificationError with the
    reason. The bytes returned are the ones verification hashed and parsed (the file is not
    read again)."""
    report = verify(directory, Trust(keyring=Keyring.load(keyring_file)), policies=load_policies(),
                    expected_kind="plan", newer_than=running_version, job=job)
    if not report.ok:
        f = report.failure
        raise VerificationError(f.name, f.message)
    scope, job_id = report.facts.get("scope"), job.get("id") or ""
    if not any_scope and scope != EVERY_JOB and not (job_id and scope == job_id):
        # another job's plan, validly signed, replayed to this one
        raise VerificationError("scope", f"the plan is signed for {scope!r}, not for this job "
                                         f"({job_id or 'no id'}) nor for every job ({EVERY_JOB})")
    if report.plan_bytes is None:
        raise VerificationError("plan", "a plan bundle must hold plan.json")
    if registry is None:
        from rtxops.runtime.registry import default_registry

        registry = default_registry()
    # what the signature and the policies vouched for is the signed source; the job runs its own
    unlike = unlike_local(report.facts.get("variants") or [], registry)
    if unlike:
        raise VerificationError("kernels", unlike)
    return report.plan_bytes


def _warm_signing(authority: Authority) -> None:
    from . import sbom

    # Not niced: a thread holding the GIL while the scheduler keeps it off the CPU stalls every
    # other thread of the daemon (HTTP, ingest, supervision); under load a niced warm-up made a
    # plan publish take over a minute. The warm-up is about a second of CPU.
    stages = (sbom._environment, lambda: sbom.schema_problem("{}"), lambda: authority.policies)
    for stage in stages:
        if authority._warm_stop.is_set():
            return
        try:
            stage()
        except Exception:  # only a head start: the first bundle does it again and reports errors
            return


def warm_up() -> None:
    """Load what verifying needs (schema validator, CEL, policies) ahead of the first bundle."""
    from . import sbom

    sbom.schema_problem("{}")
    load_policies()


def job_verifier(keyring_file: str, job: dict):
    """A callable for the runtime: ``(files, running_version) -> plan.json bytes``, raising an
    exception whose message says why a bundle is refused."""
    import tempfile

    from ._layout import MAX_METADATA_BYTES, check_name

    def verify_files(files: dict[str, bytes], running_version: int) -> bytes:
        with tempfile.TemporaryDirectory(prefix="rtxops-bundle-") as tmp:
            root = Path(tmp)
            total = 0
            for name, data in files.items():
                check_name(name)
                total += len(data)
                if total > 8 * MAX_METADATA_BYTES:
                    raise VerificationError("input", "the bundle is too large (oversized input)")
                path = root / name
                try:
                    path.parent.mkdir(parents=True, exist_ok=True)
                    path.write_bytes(data)
                except OSError as e:  # "kernels" both a file and a folder, say
                    raise VerificationError("manifest", f"file {name!r} cannot be laid out: "
                                                        f"{e.strerror or e}") from None
            return verify_plan_directory(root, keyring_file, job, running_version)

    return verify_files


def plan_verifier_for_job(keyring_file: str, job):
    """The job's plan verifier (named in ``RTXOPS_PLAN_VERIFIER`` by whoever launches the job; the
    runtime imports no governance itself): ``(files, running_version, directory=None) -> plan.json
    bytes`` against ``keyring_file``; ``job()`` gives the job's facts for the policies at each
    verification. ``.warm()`` loads what verifying needs ahead of the first bundle."""

    def verify(files: dict[str, bytes], running_version: int, directory: str | None = None) -> bytes:
        if directory is not None:
            # a bundle the user named at launch (`rtxops run --plan DIR`, a tuned plan shipped
            # with a model): verified whole, whichever job it was tuned for. The scope guards
            # the daemon's channel, where the job does not choose what it is sent
            return verify_plan_directory(directory, keyring_file, job(), running_version,
                                         any_scope=True)
        return job_verifier(keyring_file, job())(files, running_version)

    verify.warm = warm_up  # type: ignore[attr-defined]
    return verify


__all__ = ["Authority", "bundle_files", "job_verifier", "plan_verifier_for_job",
           "verify_plan_directory"]
