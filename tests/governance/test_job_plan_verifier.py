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
