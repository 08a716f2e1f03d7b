"""Resource attributes of a job process, per DESIGN.md (OTel names plus rtx.job.id and rtx.rank)."""
from __future__ import annotations

import importlib.metadata
import os
import platform
import socket
import uuid

import torch

from . import schema as S


def job_resource_attributes() -> dict:
    attrs = {
        S.SERVICE_NAME: os.environ.get("OTEL_SERVICE_NAME", "rtxops-job"),
        S.HOST_NAME: socket.gethostname(),
        S.PROCESS_PID: os.getpid(),
        S.JOB_ID: os.environ.get("RTXOPS_JOB_ID") or f"local-{uuid.uuid4().hex[:12]}",
        S.RANK: int(os.environ.get("RANK", os.environ.get("RTXOPS_RANK", "0"))),
        S.HW_CPU_MODEL: cpu_model(),
        S.TORCH_VERSION: torch.__version__,
        S.HW_GPU_COUNT: torch.cuda.device_count() if torch.cuda.is_available() else 0,
    }
    if torch.cuda.is_available():
        attrs[S.HW_GPU_MODEL] = torch.cuda.get_device_name(0)
        attrs[S.CUDA_VERSION] = torch.version.cuda or ""
    try:  # the installed distribution's version: importing triton costs ~0.1 s at job start
        attrs[S.TRITON_VERSION] = importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        pass
    return attrs


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
