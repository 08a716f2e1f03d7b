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
