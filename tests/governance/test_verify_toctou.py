"""Verification hashes the very bytes it parses and returns: a plan.json (or SBOM, provenance)
swapped on disk after the hashing threads read it cannot slip through."""
from __future__ import annotations

import json
import shutil

import pytest

import importlib

from rtxops.governance import _layout
from rtxops.governance._errors import VerificationError
from rtxops.governance.authority import verify_plan_directory

verify_mod = importlib.import_module("rtxops.governance.verify")


def swapping_after_hashing(monkeypatch, path, data: bytes):
    real = verify_mod.hash_files

    def hash_then_swap(root, names):
        future = real(root, names)
        future.result()  # the hashing threads have read the original
        path.write_bytes(data)  # ... and now the attacker swaps the file
        return future

    monkeypatch.setattr(verify_mod, "hash_files", hash_then_swap)


def test_plan_swapped_after_hashing_is_not_returned(good_plan, keys, tmp_path, monkeypatch):
    bundle = shutil.copytree(good_plan, tmp_path / "b")
    original = (bundle / _layout.PLAN).read_bytes()
    plan = json.loads(original)
    plan["defaults"] = {"gelu": "reference"}  # same version, another plan
    swapping_after_hashing(monkeypatch, bundle / _layout.PLAN, json.dumps(plan).encode())
    try:
        got = verify_plan_directory(bundle, str(keys.keyring_file), {"id": "job-1"}, 0)
    except VerificationError as e:
        assert "plan.json" in str(e)
    else:
        assert got == original


@pytest.mark.parametrize("name", [_layout.SBOM, _layout.PROVENANCE])
def test_metadata_swapped_after_hashing_is_refused(name, good_plan, keys, tmp_path, monkeypatch):
    bundle = shutil.copytree(good_plan, tmp_path / "b")
    data = json.loads((bundle / name).read_bytes())
    swapping_after_hashing(monkeypatch, bundle / name, json.dumps(data, indent=1).encode())
    report = verify_mod.verify(bundle, verify_mod.Trust(keyring=verify_mod.Keyring.load(keys.keyring_file)))
    assert not report.ok and report.failure.name == "files"


@pytest.mark.parametrize("swap", ["fifo", "link to /dev/zero"])
def test_a_file_swapped_for_a_fifo_or_a_device_after_the_listing_fails_not_hangs(
        swap, good_plan, keys, tmp_path, monkeypatch):
    import os
    import threading

    bundle = shutil.copytree(good_plan, tmp_path / "b")
    real = verify_mod.list_files
    (target,) = (bundle / "kernels").iterdir()   # a file only hashed, never parsed

    def list_then_swap(root):
        names = real(root)
        target.unlink()
        os.mkfifo(target) if swap == "fifo" else os.symlink("/dev/zero", target)
        return names

    monkeypatch.setattr(verify_mod, "list_files", list_then_swap)
    got = []
    trust = verify_mod.Trust(keyring=verify_mod.Keyring.load(keys.keyring_file))
    worker = threading.Thread(target=lambda: got.append(verify_mod.verify(bundle, trust)), daemon=True)
    worker.start()
    worker.join(30)
    if worker.is_alive():    # unblock the hashing thread stuck on the FIFO, then fail
        with open(target, "wb", buffering=0) if swap == "fifo" else open(os.devnull, "wb"):
            pass
        pytest.fail("verify hung on the swapped file")
    report = got[0]
    assert not report.ok and target.name in report.failure.message
    assert any(why in report.failure.message for why in ("not a regular file", "symbolic links"))
