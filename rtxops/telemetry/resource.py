"""Resource attributes of a job process, per DESIGN.md (OTel names plus rtx.job.id and rtx.rank)."""
from __future__ import annotations

import importlib.metadata
import logging
import os
import platform
import socket
import urllib.parse
import uuid

import torch

from . import schema as S

log = logging.getLogger("rtxops.telemetry")
DEFAULT_SERVICE_NAME = "rtxops-job"


def job_resource_attributes() -> dict:
    attrs = {
        S.SERVICE_NAME: service_name(),
        S.HOST_NAME: socket.gethostname(),
        S.PROCESS_PID: os.getpid(),
        S.JOB_ID: os.environ.get("RTXOPS_JOB_ID") or f"local-{uuid.uuid4().hex[:12]}",
        S.RANK: rank(),
        S.HW_CPU_MODEL: cpu_model(),
        S.TORCH_VERSION: torch.__version__,
        **gpu_attributes(),
    }
    try:  # the installed distribution's version: importing triton costs ~0.1 s at job start
        attrs[S.TRITON_VERSION] = importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        pass
    return attrs


def gpu_attributes() -> dict:
    """GPU count, model and CUDA version, once the job has initialized CUDA itself; before that,
    no GPU (0). Asking torch sooner initializes CUDA as the script imports torch: a
    ``CUDA_VISIBLE_DEVICES`` the script sets is then ignored, and its forked workers cannot use
    CUDA. The job's telemetry asks again at each export until it is (:func:`.job.start_job_telemetry`)."""
    if not torch.cuda.is_initialized():
        return {S.HW_GPU_COUNT: 0}
    return {S.HW_GPU_COUNT: torch.cuda.device_count(), S.HW_GPU_MODEL: torch.cuda.get_device_name(0),
            S.CUDA_VERSION: torch.version.cuda or ""}


def service_name() -> str:
    """``service.name`` as the OpenTelemetry SDK takes it: ``OTEL_SERVICE_NAME``, else the one
    ``OTEL_RESOURCE_ATTRIBUTES`` names, else ``rtxops-job``."""
    name = os.environ.get("OTEL_SERVICE_NAME", "").strip()
    if name:
        return name
    for item in os.environ.get("OTEL_RESOURCE_ATTRIBUTES", "").split(","):
        key, equals, value = item.partition("=")
        if equals and key.strip() == S.SERVICE_NAME and value.strip():
            return urllib.parse.unquote(value.strip())
    return DEFAULT_SERVICE_NAME


def rank() -> int:
    """The process's rank (``rtx.rank``): ``RANK`` (torchrun's), else ``RTXOPS_RANK``, else 0; an
    empty one counts as unset, one that is no integer as 0 (with a warning), so a stray value
    costs the job its rank label, never its telemetry."""
    for name in ("RANK", "RTXOPS_RANK"):
        raw = os.environ.get(name, "").strip()
        if not raw:
            continue
        try:
            return int(raw)
        except ValueError:
            log.warning("rtxops: %s=%r is not a rank; the job's telemetry says rank 0", name, raw)
            return 0
    return 0


def cpu_model() -> str:
    """The CPU's model name (hw.cpu.model; also part of the tuning database's key)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
