"""Bucket keys: the cheap hashable identity of "which kernel is best for this call".

On the hot path a bucket is a plain tuple ``(dtype, device_type, *dims)`` built by the op's
``bucket`` function; :class:`Bucket` is its readable form, used by plans and telemetry.
"""
from __future__ import annotations

from dataclasses import dataclass

from typing import TYPE_CHECKING

from .errors import PlanError

if TYPE_CHECKING:  # torch is imported lazily: plans and buckets are read where torch is not needed
    import torch

DTYPE_NAMES = ("float32", "float16", "bfloat16", "float64", "int64", "int32")


def pow2(n: int) -> int:
    """Round ``n`` up to a power of two (0 and 1 stay as they are)."""
    return n if n <= 1 else 1 << (n - 1).bit_length()


def device_type(t: torch.Tensor) -> str:
    """The device type of ``t`` without building a ``torch.device`` in the common cases."""
    return "cpu" if t.is_cpu else ("cuda" if t.is_cuda else t.device.type)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    check_dtype_name(name)
    import torch

    return getattr(torch, name)


def check_dtype_name(name: str) -> None:
    if name not in DTYPE_NAMES:
        raise PlanError(f"unknown dtype {name!r} (known: {', '.join(sorted(DTYPE_NAMES))})")


@dataclass(frozen=True)
class Bucket:
    """Readable bucket: op, dtype, device type and named dims."""

    op: str
    dtype: str
    device: str
    dims: tuple[tuple[str, int], ...]

    @classmethod
    def from_key(cls, op: str, fields: tuple[str, ...], key: tuple) -> Bucket:
        dtype, device, *dims = key
        return cls(op, dtype_name(dtype), device, tuple(zip(fields, dims)))

    @classmethod
    def parse(cls, op: str, text: str) -> Bucket:
        """Parse ``"float32/cpu/hidden=64,rows=512"`` (the form :attr:`id` prints)."""
        try:
            dtype, device, dims = text.split("/")
            pairs = tuple(
                (name, int(value)) for name, value in (d.split("=") for d in dims.split(",") if d)
            )
        except ValueError:
            raise PlanError(
                f"bucket {text!r} for op {op!r} is not of the form 'dtype/device/name=int,...'"
            ) from None
        check_dtype_name(dtype)
        return cls(op, dtype, device, pairs)

    @property
    def id(self) -> str:
        return f"{self.dtype}/{self.device}/" + ",".join(f"{k}={v}" for k, v in self.dims)

    @property
    def torch_dtype(self) -> torch.dtype:
        return dtype_from_name(self.dtype)

    def dim(self, name: str) -> int:
        return dict(self.dims)[name]

    def key(self) -> tuple:
        """The hot-path tuple this bucket stands for."""
        return (self.torch_dtype, self.device, *(v for _, v in self.dims))

    def __str__(self) -> str:
        return f"{self.op}[{self.id}]"
