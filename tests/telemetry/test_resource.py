"""A job's resource attributes from its environment: service.name as the OpenTelemetry SDK takes
it, and a rank that a stray value cannot turn into a job without telemetry."""
from __future__ import annotations

import pytest
from opentelemetry.sdk.resources import Resource

from rtxops.telemetry import schema as S
from rtxops.telemetry.resource import job_resource_attributes


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for name in ("OTEL_SERVICE_NAME", "OTEL_RESOURCE_ATTRIBUTES", "RANK", "RTXOPS_RANK"):
        monkeypatch.delenv(name, raising=False)


def resource() -> dict:
    return dict(Resource.create(job_resource_attributes()).attributes)


def test_service_name_follows_the_sdks_order(monkeypatch):
    assert resource()[S.SERVICE_NAME] == "rtxops-job"
    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "deployment.environment=dev,service.name=my%20trainer")
    attrs = resource()
    assert attrs[S.SERVICE_NAME] == "my trainer" and attrs["deployment.environment"] == "dev"
    monkeypatch.setenv("OTEL_SERVICE_NAME", "trainer-7")
    assert resource()[S.SERVICE_NAME] == "trainer-7"


@pytest.mark.parametrize("env, want", [
    ({}, 0),
    ({"RANK": "3"}, 3),
    ({"RTXOPS_RANK": "2"}, 2),
    ({"RANK": "", "RTXOPS_RANK": "2"}, 2),    # an empty RANK is unset
    ({"RANK": " 5 "}, 5),
    ({"RANK": "first"}, 0),                   # not a rank: labelled 0, the telemetry goes on
])
def test_the_rank_comes_from_rank_or_rtxops_rank(monkeypatch, env, want):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert resource()[S.RANK] == want
