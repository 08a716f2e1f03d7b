"""Small models and plan builders shared by runtime tests."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from rtxops.runtime.plan import Plan, PlanEntry
from rtxops.runtime.registry import default_registry


class TinyRMSNorm(nn.Module):
    """Named like the modules rtxops looks for; hand-written math as in Llama."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim) + 0.01 * torch.arange(dim))
        self.variance_epsilon = eps

    def forward(self, x):
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * x.to(dtype)


class LlamaMLP(nn.Module):
    """A Llama-style gated MLP: its forward is swiglu, then the down projection."""

    def __init__(self, dim: int = 8, hidden: int = 16):
        super().__init__()
        self.gate_proj, self.up_proj = nn.Linear(dim, hidden), nn.Linear(dim, hidden)
        self.down_proj = nn.Linear(hidden, dim)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class GeluGatedMLP(LlamaMLP):
    """The gated-MLP layout with gelu: its forward is not swiglu."""

    def forward(self, x):
        return self.down_proj(F.gelu(self.gate_proj(x)) * self.up_proj(x))


class TinyNet(nn.Module):
    def __init__(self, dim: int = 32, classes: int = 10):
        super().__init__()
        self.fc1 = nn.Linear(dim, 64)
        self.ln = nn.LayerNorm(64)
        self.fc2 = nn.Linear(64, classes)

    def forward(self, x):
        return self.fc2(F.gelu(self.ln(self.fc1(x))))


def train_losses(model: nn.Module, steps: int = 5, seed: int = 0) -> list[float]:
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for _ in range(steps):
        x = torch.randn(16, 32, generator=g)
        y = torch.randint(0, 10, (16,), generator=g)
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def bucket_id(op: str, *args, **kwargs) -> str:
    spec = default_registry().op(op)
    return spec.to_bucket(spec.bucket(*args, **kwargs)).id


def plan_for(version: int, *entries: tuple, defaults: dict | None = None) -> Plan:
    """A plan from (op, bucket, variant[, config[, explore]]) tuples."""
    es = []
    for e in entries:
        op, bucket, variant, *rest = e
        config = rest[0] if rest else {}
        explore = rest[1] if len(rest) > 1 else ()
        es.append(PlanEntry(op, bucket, variant, config, tuple(explore)))
    return Plan(version=version, entries=tuple(es), defaults=defaults or {})
