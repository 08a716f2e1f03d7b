"""Sign and verify a bundle holding a 100 MB checkpoint file: rtxops key mode (SBOM, provenance,
DSSE) against one ``hashlib.sha256`` pass over the same file and against the ``model_signing``
library's key-mode sign/verify of the same directory, in the same run (page cache warm for all).

Targets (issue #6): sign and verify each <= 1.5 x the sha256 pass and no slower than model_signing.
Reports the best and median of ``--runs`` round-robin rounds (after one warm-up call each), plus the first (cold) call
of rtxops in this process. Prints JSON; writes bench/results/sign_verify.json.
"""
from __future__ import annotations

import argparse
import hashlib
import os
import platform
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from _report import report

RESULTS = Path(__file__).parent / "results" / "sign_verify.json"


def interleaved(fns, runs: int) -> list[dict]:
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(runs):
        for i, fn in enumerate(fns):
            t = time.perf_counter()
            fn()
            times[i].append(time.perf_counter() - t)
    return [{"best_s": round(min(ts), 4), "median_s": round(statistics.median(ts), 4)} for ts in times]


def sha256_pass(path: Path) -> None:
    h = hashlib.sha256()
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(1 << 20)
        view = memoryview(buf)
        while n := f.readinto(buf):
            h.update(view[:n])
    h.hexdigest()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--mb", type=int, default=100)
    ap.add_argument("--runs", type=int, default=9)
    ap.add_argument("--out", type=Path, help=f"also write the JSON here (the saved run: {RESULTS.name})")
    args = ap.parse_args()

    from rtxops.governance import Signer, Trust, generate_key, load_policies, verify

    tmp = Path(tempfile.mkdtemp(prefix="rtxops-bench-sign-"))
    try:
        key = tmp / "key.pem"
        generate_key(key)
        ours, theirs = tmp / "ours", tmp / "theirs"
        for d in (ours, theirs):
            d.mkdir()
        blob = os.urandom(args.mb << 20)
        for d in (ours, theirs):
            (d / "model.safetensors").write_bytes(blob)
            (d / "config.json").write_text('{"hidden": 4096}')
        del blob
        ckpt = ours / "model.safetensors"

        signer = Signer.from_key_file(key)
        pem = key.with_suffix(".pub").read_bytes()
        policies = load_policies()
        t = time.perf_counter()
        signer.sign_directory(ours, kind="checkpoint")
        cold_sign = time.perf_counter() - t
        trust = Trust(public_key=pem)
        t = time.perf_counter()
        verdict = verify(ours, trust, policies=policies)
        cold_verify = time.perf_counter() - t
        assert verdict.ok, verdict.lines()

        import model_signing

        sig = theirs / "model.sig"
        ms_sign_cfg = model_signing.signing.Config().use_elliptic_key_signer(private_key=key)
        ms_verify_cfg = model_signing.verifying.Config().use_elliptic_key_verifier(
            public_key=key.with_suffix(".pub"))
        ms_sign_cfg.set_hashing_config(model_signing.hashing.Config().set_ignored_paths(paths=[sig]))
        ms_verify_cfg.set_hashing_config(model_signing.hashing.Config().set_ignored_paths(paths=[sig]))
        ms_sign_cfg.sign(theirs, sig)
        ms_verify_cfg.verify(theirs, sig)
        # round-robin, so that a busy moment of a shared machine hits every contender alike
        sha, sign, ver, ms_sign, ms_verify = interleaved([
            lambda: sha256_pass(ckpt),
            lambda: signer.sign_directory(ours, kind="checkpoint"),
            lambda: verify(ours, trust, policies=policies),
            lambda: ms_sign_cfg.sign(theirs, sig),
            lambda: ms_verify_cfg.verify(theirs, sig)], args.runs)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    def ratio(a, b, stat="best_s"):
        return round(a[stat] / b[stat], 2)

    result = {
        "bench": "sign_verify", "checkpoint_mb": args.mb, "runs": args.runs,
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "sha256_pass": sha,
        "rtxops_sign": sign, "rtxops_verify": ver,
        "rtxops_cold_first_call_s": {"sign": round(cold_sign, 4), "verify": round(cold_verify, 4)},
        "model_signing_sign": ms_sign, "model_signing_verify": ms_verify,
        "sign_vs_sha256": ratio(sign, sha), "verify_vs_sha256": ratio(ver, sha),
        "sign_vs_model_signing": ratio(sign, ms_sign), "verify_vs_model_signing": ratio(ver, ms_verify),
        "median_ratios": {"sign_vs_sha256": ratio(sign, sha, "median_s"),
                          "verify_vs_sha256": ratio(ver, sha, "median_s"),
                          "sign_vs_model_signing": ratio(sign, ms_sign, "median_s"),
                          "verify_vs_model_signing": ratio(ver, ms_verify, "median_s")},
        "load_average_1m": round(os.getloadavg()[0], 2),
        "targets": {"vs_sha256_max": 1.5, "vs_model_signing_max": 1.0},
    }
    result["met"] = {
        "sign_vs_sha256": result["sign_vs_sha256"] <= 1.5,
        "verify_vs_sha256": result["verify_vs_sha256"] <= 1.5,
        "sign_vs_model_signing": result["sign_vs_model_signing"] <= 1.0,
        "verify_vs_model_signing": result["verify_vs_model_signing"] <= 1.0,
    }
    report(result, args.out)


if __name__ == "__main__":
    main()
