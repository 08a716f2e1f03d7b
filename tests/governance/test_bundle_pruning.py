"""Explore rounds' bundles are pruned to the newest few per scope; every other bundle stays, and
the ledger keeps every entry."""
from rtxops.governance import authority as authority_module
from rtxops.governance.authority import Authority
from rtxops.runtime.plan import Plan, PlanEntry
from rtxops.runtime.registry import default_registry
from rtxops.telemetry.store import Store


def test_only_the_newest_explore_bundles_stay(tmp_path, monkeypatch):
    monkeypatch.setattr(authority_module, "EXPLORE_BUNDLES_KEPT", 3)
    registry = default_registry()
    with Store(tmp_path / "store.duckdb") as store:
        authority = Authority(tmp_path / "home", store)

        def issue(version: int, scope: str, kind: str) -> None:
            plan = Plan(version=version, entries=(PlanEntry("gelu", "float32/cpu/rows=8,hidden=16",
                                                            "reference"),))
            authority.issue_plan(plan, scope, registry, decision={"kind": kind})

        issue(1, "job-a", "manual")
        for version in range(2, 9):
            issue(version, "job-a", "explore")
        issue(9, "job-a", "manual")
        for version in range(1, 6):
            issue(version, "job-b", "explore")

        def on_disk(scope: str) -> list[int]:
            return sorted(v for v in range(1, 10) if authority.bundle_dir(scope, v).is_dir())

        assert on_disk("job-a") == [1, 6, 7, 8, 9]     # the manual ones and the newest 3 explore
        assert on_disk("job-b") == [3, 4, 5]           # scopes are pruned separately
        entries = store.query("SELECT scope, version FROM ledger ORDER BY seq")
        assert len(entries) == 14                       # the ledger keeps every entry
