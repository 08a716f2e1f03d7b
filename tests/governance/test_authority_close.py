"""The daemon's governance warm-up (imports, environment SBOM, policies on a background thread) is
stopped and waited for at shutdown: an interpreter finalizing while a thread imports C
extensions can abort, which a short `rtxops run` once did under load."""
from __future__ import annotations

from rtxops.governance.authority import Authority


def test_close_waits_for_the_warm_up(tmp_path):
    authority = Authority(tmp_path / "gov")
    authority.close()
    assert not authority._warm.is_alive()


def test_a_stopped_warm_up_leaves_the_policies_to_first_use(tmp_path):
    authority = Authority(tmp_path / "gov")
    authority.close()
    assert authority.policies  # loaded on first use, stopped warm-up or not
