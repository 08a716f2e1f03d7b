"""``rtxops keys|sign|verify|policy|ledger|plan``: governance commands. Thin: parse, call
:mod:`rtxops.governance`, print. Exit codes: 0 ok, 1 verification or check failed, 2 bad usage or
unreadable input."""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import stat
import tempfile
import time
from pathlib import Path
from typing import List, Optional

import typer
from rich.console import Console

from rtxops.cli_text import HomeOpt, inert

err = Console(stderr=True, emoji=False)
out = Console(highlight=False, soft_wrap=True, markup=False, emoji=False)  # names, paths as they are

keys_app = typer.Typer(help="Signing keys and the trusted keyring.", no_args_is_help=True)
policy_app = typer.Typer(help="CEL policies over bundles.", no_args_is_help=True)
ledger_app = typer.Typer(help="The hash-chained ledger of signed decisions.", no_args_is_help=True)
plan_app = typer.Typer(help="Move signed plans between machines.", no_args_is_help=True)


def register(app: typer.Typer) -> None:
    """Add the governance commands to the ``rtxops`` app."""
    app.add_typer(keys_app, name="keys")
    app.add_typer(policy_app, name="policy")
    app.add_typer(ledger_app, name="ledger")
    app.add_typer(plan_app, name="plan")
    app.command("sign")(sign)
    app.command("verify")(verify)


def _home(home: Optional[Path]):
    from rtxops.daemon.home import Home

    return Home.resolve(home)


def _fail(message: str, code: int = 2) -> typer.Exit:
    err.print(f"rtxops: {inert(message)}", markup=False)   # (a bundle's names and fields in it)
    return typer.Exit(code)


def _keyring_path(keyring: Optional[Path], home: Optional[Path]) -> Path:
    return keyring or _home(home).root / "keyring.json"


def _guard(fn):
    """Governance usage errors → exit 2 with the message."""
    from rtxops.governance import GovernanceError, VerificationError

    try:
        return fn()
    except VerificationError as e:
        raise _fail(str(e), 1) from None
    except GovernanceError as e:
        raise _fail(str(e), 2) from None


# ---- keys ----------------------------------------------------------------------------------------
DEFAULT_TRUST_KINDS = ("checkpoint", "telemetry", "ledger")   # plans are the daemon's

DEFAULT_KEY_KINDS = "checkpoint,telemetry,ledger"   # plans are the daemon's to sign


@keys_app.command("init")
def keys_init(name: str = typer.Option("signing", help="key file name under $RTXOPS_HOME/keys"),
              out_path: Optional[Path] = typer.Option(None, "--out", help="private key path"),
              trust: bool = typer.Option(True, help="also trust the new key in the keyring"),
              kinds: str = typer.Option(DEFAULT_KEY_KINDS,
                                        help="kinds it may sign (plans are the daemon's: add plan "
                                             "only for a key that stands in for one)"),
              keyring: Optional[Path] = typer.Option(None), home: Optional[Path] = HomeOpt) -> None:
    """Make an ECDSA P-256 key pair (private key mode 0600) and trust its public key."""
    from rtxops.governance import Keyring, generate_key

    from rtxops.governance.keyring import TRUST_KINDS as KINDS

    unknown = [k for k in kinds.split(",") if k not in KINDS]
    if unknown:  # before a key pair is written under a name a rerun could not use
        raise _fail(f"unknown artifact kind {unknown[0]!r} (kinds: {', '.join(KINDS)})")
    private = out_path or _home(home).root / "keys" / f"{name}.pem"
    # the keyring first: one that cannot be read must not leave an untrusted key pair behind
    with (_guard(lambda: Keyring.editing(_keyring_path(keyring, home))) if trust
          else contextlib.nullcontext()) as ring:
        kid = _guard(lambda: generate_key(private))
        public = private.with_suffix(".pub")
        if ring is not None:
            _guard(lambda: ring.trust(public.read_bytes(), name=name, kinds=kinds.split(",")))
    out.print(f"key {kid}\nprivate {private}\npublic  {public}" + ("\ntrusted" if trust else ""))


@keys_app.command("list")
def keys_list(keyring: Optional[Path] = typer.Option(None), home: Optional[Path] = HomeOpt,
              as_json: bool = typer.Option(False, "--json")) -> None:
    """The trusted keys: id, name, kinds, validity, revocation."""
    from dataclasses import asdict

    from rtxops.governance import Keyring

    ring = _guard(lambda: Keyring.load(_keyring_path(keyring, home)))
    if as_json:
        out.print(json.dumps([asdict(k) for k in ring.keys.values()], indent=1))
        return
    now = time.time()
    if not ring.keys:
        out.print(f"no keys trusted in {_keyring_path(keyring, home)}")
    for k in ring.keys.values():
        state = k.problem(None, now) or "valid"
        out.print(f"{k.key_id[:16]}  {k.name or '-':<16} {','.join(k.kinds):<34} {state}")


@keys_app.command("trust")
def keys_trust(public_key: Path = typer.Argument(..., help="PEM public key"),
               name: str = typer.Option(""),
               kinds: Optional[str] = typer.Option(
                   None, help="kinds it may sign (default for a new key: checkpoint,telemetry,"
                              "ledger; plans are the daemon's: add plan only for a key that stands "
                              "in for one). A key trusted already gains them"),
               replace: bool = typer.Option(False, help="a key trusted already gets exactly these "
                                                        "kinds, name and validity"),
               days: Optional[float] = typer.Option(None, help="valid for this many days (default: no end)"),
               keyring: Optional[Path] = typer.Option(None), home: Optional[Path] = HomeOpt) -> None:
    """Trust a public key for the given artifact kinds (a key trusted already gains them)."""
    from rtxops.governance import Keyring

    try:
        pem = public_key.read_bytes()
    except OSError as e:
        raise _fail(f"cannot read {public_key}: {e.strerror}") from None
    if days is not None and not (0 < days < 1e6):  # nan, inf: a key that never expires
        raise _fail(f"--days {days:g}: give a positive number of days")
    with _guard(lambda: Keyring.editing(_keyring_path(keyring, home))) as ring:
        now = time.time()
        known = not replace and _guard(lambda: ring.entry_of(pem)) is not None
        given = kinds.split(",") if kinds else ([] if known else list(DEFAULT_TRUST_KINDS))
        before = set(_guard(lambda: ring.entry_of(pem)).kinds) if known else set()
        entry = _guard(lambda: ring.trust(
            pem, name=name, kinds=given, add=known,
            not_before=now if days else None, not_after=now + days * 86400 if days else None))
    added = [k for k in entry.kinds if k not in before]
    if known:
        expired = entry.not_after is not None and entry.not_after <= time.time()
        out.print(f"trusted {entry.key_id} for {','.join(entry.kinds)}"
                  + (f" (added {','.join(added)})" if added else " (no kind added)")
                  + ("; it has expired: --days N renews it" if expired else ""))
        return
    out.print(f"trusted {entry.key_id} for {','.join(entry.kinds)}")


@keys_app.command("revoke")
def keys_revoke(key_id: str, reason: str = typer.Option(""), keyring: Optional[Path] = typer.Option(None),
                home: Optional[Path] = HomeOpt) -> None:
    """Revoke a key: bundles it signed no longer verify."""
    from rtxops.governance import Keyring

    with _guard(lambda: Keyring.editing(_keyring_path(keyring, home))) as ring:
        already = _guard(lambda: ring.find(key_id)).revoked_at is not None
        entry = _guard(lambda: ring.revoke(key_id, reason))
    out.print(f"{entry.key_id} was already revoked ({entry.revoked_reason or 'no reason given'}): "
              "the first revocation stands" if already else f"revoked {entry.key_id}")


# ---- sign / verify -------------------------------------------------------------------------------
def sign(directory: Path = typer.Argument(..., help="directory to turn into a bundle"),
         kind: str = typer.Option("checkpoint", help="plan|checkpoint|telemetry|ledger"),
         key: Optional[Path] = typer.Option(None, help="private key (default: $RTXOPS_HOME/keys/signing.pem)"),
         keyless: bool = typer.Option(False, help="sign with a Sigstore OIDC identity (online)"),
         identity_token: Optional[str] = typer.Option(
             None, help="keyless: the OIDC identity token (default: $SIGSTORE_ID_TOKEN, else an "
                        "ambient CI credential)"),
         trust_config: Optional[Path] = typer.Option(
             None, help="keyless: Sigstore ClientTrustConfig JSON of a private instance "
                        "(default: the public instance)"),
         version: int = typer.Option(0, help="artifact version (plans: plan.json's version)"),
         home: Optional[Path] = HomeOpt) -> None:
    """Turn DIR into a signed bundle: SBOM, provenance (with KIND), Sigstore bundle."""
    from rtxops.governance import KeylessSigner, Signer

    if keyless and key:
        raise _fail("give either --key or --keyless, not both")
    if not keyless and (identity_token or trust_config):
        raise _fail("--identity-token and --trust-config are for --keyless signing")
    if not directory.is_dir() or directory.is_symlink():
        raise _fail(f"{directory} is not a directory")
    if keyless:
        signer = _guard(lambda: KeylessSigner.create(identity_token, trust_config))
        who = f"as {signer.identity} ({signer.issuer})"
    else:
        if key is None:
            key = _home(home).root / "keys" / "signing.pem"
            if not key.exists():
                init = "rtxops keys init" + (f" --home {home}" if home else "") + (
                    f" --kinds {DEFAULT_KEY_KINDS},{kind}" if kind not in DEFAULT_KEY_KINDS.split(",") else "")
                raise _fail(f"no signing key at {key}: `{init}` makes one (or give --key, or --keyless)")
        signer = _guard(lambda: Signer.from_key_file(key))
        who = f"with key {signer.key_id[:16]}"
    kernels: list = []
    if kind == "plan":   # after the signer: a bad key leaves the folder as it was
        version, kernels = _plan_kernels_written(directory)
    digest = _guard(lambda: signer.sign_directory(directory, kind=kind, version=version,
                                                  kernels=kernels))
    out.print(f"signed {directory} ({kind}) {digest} {who}")


def _plan_kernels_written(directory: Path) -> tuple[int, list]:
    """A plan bundle's version and the SBOM components of the variants its plan.json uses, whose
    sources are written under ``kernels/`` (as the daemon lays a plan bundle out: `verify` wants
    the SBOM to list exactly the plan's variants, each with its signed source)."""
    from rtxops.governance._errors import VerificationError
    from rtxops.governance._kernels import plan_kernels
    from rtxops.governance._layout import list_files
    from rtxops.runtime.plan import Plan, PlanError
    from rtxops.runtime.registry import default_registry

    try:   # a symlink in the folder (kernels/ itself, say) would have the sources written through it
        list_files(directory)
    except VerificationError as e:
        raise _fail(f"cannot sign {directory}: {e.message}") from None
    try:
        plan = Plan.from_json((directory / "plan.json").read_bytes())
        plan.validate(default_registry())
    except OSError as e:
        raise _fail(f"a plan bundle needs a readable plan.json: {e.strerror}") from None
    except PlanError as e:
        raise _fail(f"{directory / 'plan.json'} is not a plan rtxops can run: {e}") from None
    kernels, sources = plan_kernels(plan, default_registry())
    for rel, text in sources.items():
        path = directory / rel
        if path.is_symlink() or (path.exists() and not path.is_file()):
            raise _fail(f"{path} is in the way of the kernel source the bundle holds there")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return plan.version, kernels


def verify(path: Path = typer.Argument(..., help="bundle directory"),
           key: Optional[Path] = typer.Option(None, help="trust exactly this PEM public key"),
           keyring: Optional[Path] = typer.Option(None, help="trusted keyring (default: $RTXOPS_HOME's)"),
           identity: Optional[str] = typer.Option(None, help="keyless: required certificate identity"),
           issuer: Optional[str] = typer.Option(None, help="keyless: required OIDC issuer"),
           trusted_root: Optional[Path] = typer.Option(None, help="keyless: pinned Sigstore trusted root"),
           kind: Optional[str] = typer.Option(None, help="require this artifact kind"),
           min_version: Optional[int] = typer.Option(None, help="refuse versions below this"),
           ledger: bool = typer.Option(True, help="refuse plan versions below the ledger's newest"),
           policy: Optional[List[Path]] = typer.Option(None, help="policy file/folder (default: shipped)"),
           no_policy: bool = typer.Option(False, "--no-policy", help="skip policies"),
           as_json: bool = typer.Option(False, "--json"), home: Optional[Path] = HomeOpt) -> None:
    """Verify a bundle offline: signature and signer, every file digest, SBOM, provenance,
    policy, version. One line per check (or JSON). Exit 0 ok, 1 failed, 2 bad usage/input."""
    from rtxops.governance import Keyring, Trust, load_policies
    from rtxops.governance import verify as run_verify

    if key and (identity or issuer):
        raise _fail("give either --key or --identity/--issuer, not both")
    if bool(identity) != bool(issuer):
        raise _fail("keyless verification needs both --identity and --issuer")
    from rtxops.governance import KINDS

    if kind is not None and kind not in KINDS:
        raise _fail(f"--kind {kind!r}: the kinds are {', '.join(KINDS)}")
    try:
        pem = key.read_bytes() if key else None
    except OSError as e:
        raise _fail(f"cannot read {key}: {e.strerror}") from None
    if keyring is not None and not key and not keyring.is_file():
        # a mistyped path read as an empty keyring: every bundle "signed by a key not in it"
        raise _fail(f"--keyring {keyring}: no such file")
    if trusted_root is not None and not trusted_root.is_file():
        raise _fail(f"--trusted-root {trusted_root}: no such file")
    trust = Trust(keyring=None if key else _guard(lambda: Keyring.load(_keyring_path(keyring, home))),
                  public_key=pem, identity=identity, issuer=issuer, trusted_root=trusted_root)
    policies = None if no_policy else _guard(lambda: load_policies(policy))
    report = _guard(lambda: run_verify(path, trust, policies=policies, expected_kind=kind,
                                       min_version=min_version))
    from rtxops.governance import Check

    if trust.keyring is not None and report.checks:   # (a report of no check stays failed)
        # the trust anchor named: without --keyring or a home it is ./.rtxops's, which a
        # downloaded folder could bring along
        where = str(trust.keyring.path)
        if not identity and not trust.keyring.path.is_file():   # (read as empty: no key trusted)
            where += ": no such file, no key trusted"
        if keyring is None and home is None and not os.environ.get("RTXOPS_HOME"):
            where += " (the home in this folder; --keyring or --home names another)"
        report.checks.insert(0, Check("trust", True, f"keyring {where}"))
    if no_policy and report.ok:
        report.checks.append(Check("policy", True, "skipped (--no-policy)"))
    if report.ok and not ledger and report.facts.get("kind") == "plan":
        report.checks.append(Check("ledger", True, "skipped (--no-ledger)"))
    if report.ok and ledger and report.facts.get("kind") == "plan":
        root = _home(home).root
        if home is None and not os.environ.get("RTXOPS_HOME") and not root.is_dir():
            # a bundle checked offline, on a machine with no rtxops home: no ledger to ask
            report.checks.append(Check("ledger", True, f"not checked: no rtxops home at {root} "
                                                       "(--home H checks against its ledger)"))
        else:  # the head's signer is the home's daemon: the home's keyring vouches for it
            problem, note = _ledger_problem(home, report.facts, None)
            if problem:
                report.checks.append(Check("ledger", False, problem))
            elif note:
                report.checks.append(Check("ledger", True, note))
    if as_json:
        out.print(json.dumps(report.to_dict(), indent=1, default=str))
    else:
        for line in report.lines():
            out.print(inert(line))
        out.print(("verified: " if report.ok else "NOT verified: ") + inert(str(path)))
    raise typer.Exit(0 if report.ok else 1)


def _ledger_entries(home: Optional[Path]) -> tuple[list[dict], dict | None]:
    """The ledger from the store file, or from the daemon when it holds the store."""
    from rtxops.governance import ledger as gl
    from rtxops.telemetry.store import ReadOnlyStore, StoreError

    h = _home(home)
    if not h.root.is_dir():  # a mistyped --home: no ledger to call intact
        raise _fail(f"no rtxops home at {h.root}")
    if not h.store.exists():
        return [], gl.read_head(h.root / "ledger.head")
    try:
        store = ReadOnlyStore(h.store)
    except StoreError as e:
        if "schema version" in str(e) or "not an rtxops store" in str(e):
            raise _fail(str(e)) from None   # not a daemon's matter
        from rtxops.daemon.client import DaemonClient, DaemonError

        client = DaemonClient.find(h)
        if client is None:  # locked by a daemon that does not answer, or not a store at all
            raise _fail(f"{e} (and no daemon answers for {h.root})") from None
        rows: list[dict] = []
        try:
            while True:  # pages of 1000 (append-only: a page never shifts); the last page's head
                data = client._call("GET", f"/v1/plans/ledger?limit=1000&offset={len(rows)}")
                rows += data["entries"]
                head = data["head"]
                if not data["entries"] or len(rows) >= data.get("total", len(rows)):
                    break
        except DaemonError as e:
            raise _fail(str(e)) from None
        return rows, head
    try:
        from duckdb import CatalogException, Error

        try:
            rows = gl.read_entries(store)
        except CatalogException:  # an older store without the ledger table
            rows = []
        except Error as e:  # a ledger table altered (a column dropped): not the ledger we wrote
            raise _fail(f"ledger: the ledger in {h.store} cannot be read as rtxops writes it "
                        f"({str(e).splitlines()[0]})", 1) from None
        return rows, gl.read_head(h.root / "ledger.head")
    finally:
        store.close()


def _ledger_problem(home: Optional[Path], facts: dict,
                    keyring: Optional[Path]) -> tuple[str | None, str | None]:
    """Why the ledger says this plan bundle must not be taken (a replay of an older version, or
    another bundle under a version the ledger accepted), or None; and a note when the ledger
    cannot say (it holds no plan of the bundle's signer: a bundle another home issued, imported
    here). A ledger that is not intact cannot say either: that fails."""
    rows, head = _ledger_entries(home)
    problems = _chain_problems(rows, head, keyring, home)
    if problems:
        return (f"the ledger is not intact ({problems[0]}"
                + (f"; {len(problems) - 1} more" if len(problems) > 1 else "")
                + "): `rtxops ledger verify` lists what; the replay check cannot trust it"), None
    accepted = ("promote", "rollback", "explore", "manual")  # every kind the board publishes
    scope, version = facts["scope"], facts["version"]
    signer = (facts.get("signer") or {}).get("key_id")
    # a signer this ledger never recorded issued the bundle elsewhere: another home's `_default`
    # v5 is no replay of this home's `_default` v8. A signer it did record is one of this home's
    # daemon keys (the one before a rotation too): all of the home's entries count
    if not any(r["signer"] == signer for r in rows):
        return None, (f"not checked: this home's ledger holds no plan signed by "
                      f"{str(signer)[:16]} (a bundle issued elsewhere)")
    issued = {r["version"]: r["subject_digest"] for r in rows
              if r["scope"] == scope and r["kind"] in accepted}
    newest = max(issued, default=None)
    if newest is not None and version < newest:
        return (f"version {version} is older than {newest}, the ledger's newest for {scope} "
                "(replay of an older plan)"), None
    if version in issued and issued[version] != facts.get("digest"):
        return (f"the ledger accepted another bundle as version {version} of {scope} "
                f"({issued[version][:23]}…, this one is {str(facts.get('digest'))[:23]}…)"), None
    if version in issued:
        return None, f"version {version} is the one the ledger accepted for {scope} (newest {newest})"
    return None, (f"no replay: the ledger's newest for {scope} is "
                  + (f"version {newest}" if newest is not None else "none yet") + f", this is {version}")


# ---- policy --------------------------------------------------------------------------------------
@policy_app.command("check")
def policy_check(path: Path = typer.Argument(..., help="bundle directory"),
                 policy: Optional[List[Path]] = typer.Option(None, help="policy file/folder"),
                 keyring: Optional[Path] = typer.Option(None), deterministic: bool = typer.Option(
                     False, help="evaluate as for a job that asks for determinism"),
                 home: Optional[Path] = HomeOpt) -> None:
    """Evaluate the policies on a (verified) bundle: allow → exit 0, deny → exit 1 with reasons."""
    from rtxops.governance import Keyring, Trust, load_policies
    from rtxops.governance import verify as run_verify

    trust = Trust(keyring=_guard(lambda: Keyring.load(_keyring_path(keyring, home))))
    policies = _guard(lambda: load_policies(policy))
    report = _guard(lambda: run_verify(path, trust, policies=policies,
                                       job={"deterministic": deterministic}))
    failure = report.failure
    if failure is None:
        out.print(f"allowed by {', '.join(p.name for p in policies)}")
        return
    out.print(f"denied: {failure.name}: {failure.message}")
    raise typer.Exit(1)


HEAD_EXPORT = "ledger.head.json"  # the head, beside the entries in an export


# ---- ledger --------------------------------------------------------------------------------------
@ledger_app.command("verify")
def ledger_verify(keyring: Optional[Path] = typer.Option(None, help="keyring that vouches for "
                                                                   "the head's signer"),
                  home: Optional[Path] = HomeOpt) -> None:
    """Check the hash chain and the head's signature: an edited, deleted or reordered entry, or
    a chain rewritten whole, fails (exit 1)."""
    rows, head = _ledger_entries(home)
    problems = _chain_problems(rows, head, keyring, home)
    for p in problems:
        out.print(f"FAIL {p}")
    if problems:
        raise typer.Exit(1)
    signed = (f", head signed by {head['key_id'][:16]} at "
              f"{time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime(head['signed_at']))} UTC"
              if head and "signature" in head else "")
    out.print(f"ledger intact: {len(rows)} entries{signed}")


def _chain_problems(rows: list[dict], head: dict | None, keyring: Optional[Path],
                    home: Optional[Path]) -> list[str]:
    from rtxops.governance import Keyring
    from rtxops.governance import ledger as gl

    h = _home(home)
    problems = gl.check_chain(rows, head, head_expected=(h.root / "keys" / "daemon.pem").exists())
    if not problems and head:
        ring = _guard(lambda: Keyring.load(_keyring_path(keyring, home)))
        problem = gl.head_signature_problem(head, ring)
        problems += [problem] if problem else []
        # whatever the head's signature: entries cut off the end show here, before anyone signs
        problems += gl.unrecorded_bundles(h.root / "bundles", rows, ring)
    return problems


@ledger_app.command("sign-head")
def ledger_sign_head(key: Optional[Path] = typer.Option(None, help="the daemon's key (default: "
                                                                  "$RTXOPS_HOME/keys/daemon.pem)"),
                     home: Optional[Path] = HomeOpt) -> None:
    """Sign the head of a ledger written before heads were signed, once its chain checks intact
    (exit 1 when it does not: then nothing is signed)."""
    from rtxops.governance import Keyring, Signer, VerificationError
    from rtxops.governance import ledger as gl
    from rtxops.governance._layout import HEAD_KIND

    h = _home(home)
    signer = _guard(lambda: Signer.from_key_file(key or h.root / "keys" / "daemon.pem"))
    ring = _guard(lambda: Keyring.load(_keyring_path(None, home)))
    try:   # whoever signs the head vouches for the whole chain: the daemon's key, by default
        ring.check(signer.key_id, HEAD_KIND)
    except VerificationError as e:
        raise _fail(f"{e.message} in {ring.path}: sign with the daemon's key", 1) from None
    rows, head = _ledger_entries(home)
    if head and "signature" in head:
        untrusted = gl.head_signature_problem(head, ring)
        if untrusted is None:
            out.print(f"the head (entry {head['seq']}) is signed already")
            return
        # a signer revoked or rotated away: signed anew as an unsigned head would be, once the
        # chain checks intact (its key holder vouches for the chain as it stands)
        out.print(f"the head's signature is not trusted: {untrusted}")
    # a head signed over a chain whose last entries were cut off would vouch for the cut
    problems = gl.check_chain(rows, head) or gl.unrecorded_bundles(h.root / "bundles", rows, ring)
    problems = problems or gl.sign_head(rows, head, h.root / "ledger.head", signer.key)
    for p in problems:
        out.print(f"FAIL {p}")
    if problems:
        raise typer.Exit(1)
    out.print(f"signed the head of the ledger ({len(rows)} entries) with key {signer.key_id[:16]}")


@ledger_app.command("export")
def ledger_export(out_dir: Path = typer.Argument(..., help="folder to write ledger.jsonl into"),
                  sign_it: bool = typer.Option(False, "--sign", help="sign the folder (kind ledger)"),
                  key: Optional[Path] = typer.Option(None, help="signing key (default: the daemon's)"),
                  home: Optional[Path] = HomeOpt) -> None:
    """Write every ledger entry as JSON lines; with --sign the folder becomes a signed bundle."""
    from rtxops.governance import Signer
    from rtxops.governance import ledger as gl

    rows, head = _ledger_entries(home)
    if sign_it:  # the key first: a bad one must not leave an unsigned export behind
        key = key or _home(home).root / "keys" / "daemon.pem"
        signer = _guard(lambda: Signer.from_key_file(key))
        # a signed export vouches for the ledger: as a daemon never signs over a chain it cannot
        # vouch for, nor does this (without --sign a broken ledger still exports, to look at)
        problems = _chain_problems(rows, head, None, home)
        for p in problems:
            out.print(f"FAIL {p}")
        if problems:
            raise _fail("the ledger does not check intact (`rtxops ledger verify`): nothing "
                        "signed; export it without --sign to look at it", 1)
        from rtxops.governance import PROVENANCE, SBOM, SIGNATURE

        # the signature covers the whole folder: whatever else lies there would be signed too
        # (an earlier export is replaced)
        held = {p.name for p in out_dir.iterdir()} if out_dir.is_dir() and not out_dir.is_symlink() else set()
        others = sorted(held - {"ledger.jsonl", HEAD_EXPORT, SBOM, PROVENANCE, SIGNATURE})
        if out_dir.is_symlink() or others or any((out_dir / n).is_symlink() for n in held):
            raise _fail(f"{out_dir} holds {others[0] if others else 'a symlink'}: a signed export "
                        "goes into a new or empty folder, or over an earlier export")
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "ledger.jsonl").write_text(gl.export_jsonl(rows))
    # the head (last seq and hash, signed by the daemon): a reader of the export can tell a cut
    # tail from the whole ledger
    (out_dir / HEAD_EXPORT).write_text(json.dumps(head or {}, sort_keys=True) + "\n")
    if sign_it:
        last = rows[-1]["seq"] if rows else 0
        _guard(lambda: signer.sign_directory(out_dir, kind="ledger", version=last))
    out.print(f"{len(rows)} entries → {out_dir / 'ledger.jsonl'} and {HEAD_EXPORT}" + (" (signed)" if sign_it else ""))


# ---- plan export / import ------------------------------------------------------------------------
@plan_app.command("export")
def plan_export(out_dir: Path = typer.Argument(..., help="folder to copy the signed bundle to"),
                job: Optional[str] = typer.Option(None, help="job id (default: the default plan)"),
                home: Optional[Path] = HomeOpt) -> None:
    """Copy the newest settled signed plan bundle for JOB out of $RTXOPS_HOME (ship it with a
    model; `rtxops run --plan DIR` starts another job with it). Plans still exploring
    candidates (explore weights) are passed over."""
    from rtxops.governance.authority import EVERY_JOB

    scope = job or EVERY_JOB
    bundles = _home(home).root / "bundles"
    root = bundles / scope
    versions = sorted((int(p.name[1:]), p) for p in root.glob("v*") if p.name[1:].isdigit()) if root.is_dir() else []
    if not versions:
        scopes = sorted(p.name for p in bundles.iterdir() if p.is_dir()) if bundles.is_dir() else []
        hint = ((f"; the jobs with signed plans: {', '.join(scopes)}" if job else
                 f"; plans are signed per job: give --job (one of {', '.join(scopes)})")
                if scopes else "")
        raise _fail(f"no signed plan bundle for {scope} in {bundles}{hint}")
    settled = [(v, p) for v, p in versions if _settled_plan(p)]
    if not settled:
        raise _fail(f"the plans for {scope} (versions {versions[0][0]}–{versions[-1][0]}) are all "
                    "exploring candidates or unreadable: nothing settled to ship yet")
    if out_dir.exists():
        raise _fail(f"{out_dir} exists; give a new folder")
    version, path = settled[-1]
    # what leaves the home is checked first (the copy, as it lands): an altered bundle stays
    from rtxops.governance import Keyring, Trust
    from rtxops.governance import verify as run_verify

    trust = Trust(keyring=_guard(lambda: Keyring.load(_keyring_path(None, home))))
    try:
        shutil.copytree(path, out_dir, symlinks=True)
        report = _guard(lambda: run_verify(out_dir, trust, expected_kind="plan"))
    except (OSError, shutil.Error) as e:
        shutil.rmtree(out_dir, ignore_errors=True)
        raise _fail(f"cannot copy {path} to {out_dir}: {e}") from None
    except BaseException:
        shutil.rmtree(out_dir, ignore_errors=True)
        raise
    if not report.ok:
        shutil.rmtree(out_dir, ignore_errors=True)
        failed = next(c for c in report.checks if not c.ok)
        raise _fail(f"plan version {version} for {scope} does not verify ({failed.name}: "
                    f"{failed.message}): not exported", 1)
    out.print(f"plan version {version} for {scope} → {out_dir}")


def _settled_plan(bundle: Path) -> bool:
    """Whether the bundle holds a readable plan with no explore weights."""
    from rtxops.runtime.errors import PlanError
    from rtxops.runtime.plan import Plan

    try:
        plan = Plan.from_json((bundle / "plan.json").read_bytes())
    except (OSError, PlanError):
        return False
    return not any(e.explore for e in plan.entries)


@plan_app.command("import")
def plan_import(bundle: Path = typer.Argument(..., help="signed plan bundle folder"),
                keyring: Optional[Path] = typer.Option(None), home: Optional[Path] = HomeOpt) -> None:
    """Verify a plan bundle (signature, trusted key, digests, policy) and keep a copy under
    $RTXOPS_HOME/imported; run with it via ``RTXOPS_PLAN=<that folder>``."""
    from rtxops.governance import Keyring, Trust, VerificationError, load_policies
    from rtxops.governance import verify as run_verify
    from rtxops.governance._layout import list_files

    trust = Trust(keyring=_guard(lambda: Keyring.load(_keyring_path(keyring, home))))
    policies = _guard(load_policies)
    imported = (_home(home).root / "imported").resolve()
    if imported == bundle.resolve() or bundle.resolve() in imported.parents:
        raise _fail(f"{bundle} holds this home's imported plans ({imported}): give the bundle's "
                    "own folder")  # it would be copied into itself
    if not bundle.is_dir():
        raise _fail(f"{bundle} is not a folder" if bundle.exists() else f"{bundle} does not exist")
    try:   # before the copy: a device file in it would be read without end
        list_files(bundle)
    except VerificationError as e:
        out.print(f"FAIL {e.check:<11} {e.message}")
        out.print(f"NOT verified: {bundle}")
        raise typer.Exit(1) from None
    imported.mkdir(parents=True, exist_ok=True)
    # the copy is what gets verified and kept: the folder given may change after it was read
    staging = Path(tempfile.mkdtemp(prefix=".import-", dir=imported))
    try:
        copy = staging / "bundle"
        try:   # a symlink stays one, and fails the layout
            shutil.copytree(bundle, copy, symlinks=True, copy_function=_copy_regular_file)
        except (OSError, shutil.Error) as e:
            raise _fail(f"cannot copy {bundle}: {e}") from None
        report = _guard(lambda: run_verify(copy, trust, policies=policies, expected_kind="plan"))
        for line in report.lines():
            out.print(inert(line))
        if not report.ok:
            raise typer.Exit(1)
        # the scope is checked as a folder name by verify; the resolved parent is checked again here
        target = imported / f"{report.facts['scope'] or 'plan'}-v{report.facts['version']}"
        if target.resolve().parent != imported:
            raise _fail(f"bundle scope {report.facts['scope']!r} is not a plain folder name")
        if target.exists():
            shutil.rmtree(target)
        copy.replace(target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    out.print(f"imported → {target}")


def _copy_regular_file(src: str, dst: str) -> None:
    """``shutil.copy2`` of a regular file only (one swapped for a device after the layout check
    would be read without end)."""
    if not stat.S_ISREG(os.lstat(src).st_mode):
        raise OSError(f"{src} is not a regular file")
    shutil.copy2(src, dst)
