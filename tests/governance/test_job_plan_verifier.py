"""The job's plan verifier that governance hands the runtime through RTXOPS_PLAN_VERIFIER."""
from __future__ import annotations

import pytest

from rtxops.governance._errors import VerificationError
from rtxops.governance.authority import bundle_files, plan_verifier_for_job


def test_plan_verifier_for_job_verifies_files_and_directories(good_plan, keys):
    verify = plan_verifier_for_job(str(keys.keyring_file), lambda: {"id": "job-1", "deterministic": False})
    assert callable(verify.warm)
    plan = (good_plan / "plan.json").read_bytes()
    assert verify(bundle_files(good_plan), 0) == plan
    assert verify({}, -1, directory=str(good_plan)) == plan
    with pytest.raises(VerificationError, match="not newer"):
        verify(bundle_files(good_plan), 5)


@pytest.mark.parametrize("job_id", ["job-2", ""])
def test_a_plan_signed_for_another_job_is_refused(good_plan, keys, job_id):
    """A validly signed plan of job-1, replayed to another job (or to one with no id)."""
    verify = plan_verifier_for_job(str(keys.keyring_file), lambda: {"id": job_id, "deterministic": False})
    with pytest.raises(VerificationError, match="signed for 'job-1', not for this job"):
        verify(bundle_files(good_plan), 0)


def test_a_bundle_named_at_launch_is_taken_whichever_job_it_was_tuned_for(good_plan, keys):
    """`rtxops plan export --job J` then `rtxops run --plan DIR` in another job: the user chose
    the bundle; it is verified whole but not refused for its scope (it always was)."""
    verify = plan_verifier_for_job(str(keys.keyring_file), lambda: {"id": "job-2", "deterministic": False})
    assert verify({}, -1, directory=str(good_plan)) == (good_plan / "plan.json").read_bytes()


def test_a_plan_signed_for_every_job_is_taken_by_any(keys, tmp_path):
    from .helpers import plan_bundle

    bundle = plan_bundle(tmp_path / "b", keys.signer(), 5, scope="_default")
    for job_id in ("job-2", ""):
        verify = plan_verifier_for_job(str(keys.keyring_file), lambda: {"id": job_id, "deterministic": False})
        assert verify(bundle_files(bundle), 0) == (bundle / "plan.json").read_bytes()


def test_a_name_that_is_both_a_file_and_a_folder_is_a_manifest_error(good_plan, keys):
    verify = plan_verifier_for_job(str(keys.keyring_file), lambda: {"id": "job-1", "deterministic": False})
    files = {"kernels": b"x", **bundle_files(good_plan)}
    with pytest.raises(VerificationError, match="manifest: file .* cannot be laid out"):
        verify(files, 0)


def _registry_with_gelu_algebraic(**changes):
    """The runtime's registry with gelu/algebraic as another kernel build would have it."""
    import dataclasses

    from rtxops.runtime.registry import load_builtin

    registry = load_builtin()
    registry.add_variant(dataclasses.replace(registry.variant("gelu", "algebraic"), **changes))
    return registry


def _other_build(config, bucket):   # a build from this module: another source than the runtime's
    import torch.nn.functional as F

    return F.gelu


@pytest.mark.parametrize("changes, reason", [
    ({"build": _other_build}, r"kernels: gelu/algebraic: this job's source .* is not the signed one"),
    ({"deterministic": False}, "kernels: gelu/algebraic: deterministic is False here, True in the signed SBOM"),
])
def test_a_plan_signed_for_another_kernel_build_is_refused(good_plan, keys, changes, reason):
    """The signature, SBOM and policies vouch for the signed source; the job runs its own. A
    bundle signed where gelu/algebraic differs from this job's is refused, from the daemon's
    channel and from a directory named at launch alike."""
    from rtxops.governance.authority import verify_plan_directory

    job = {"id": "job-1", "deterministic": False}
    other = _registry_with_gelu_algebraic(**changes)
    with pytest.raises(VerificationError, match=reason):
        verify_plan_directory(good_plan, str(keys.keyring_file), job, 0, registry=other)
    with pytest.raises(VerificationError, match=reason):
        verify_plan_directory(good_plan, str(keys.keyring_file), job, -1, any_scope=True, registry=other)
    assert verify_plan_directory(good_plan, str(keys.keyring_file), job, 0) == \
        (good_plan / "plan.json").read_bytes()
