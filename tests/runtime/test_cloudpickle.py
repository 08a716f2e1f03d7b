"""A job under rtxops hands its ``__main__`` model to other processes with cloudpickle (Ray,
joblib's loky, submitit), which ships such classes and functions by value: with the wrappers
rtxops put in their place."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

DRIVER = '''
import sys, torch, cloudpickle
from torch import nn
import torch.nn.functional as F

class RMSNorm(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim) + 0.1 * torch.arange(dim))
        self.eps = 1e-6

    def forward(self, x):
        x32 = x.float()
        return self.weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)

class FeedForward(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.gate_proj, self.up_proj = nn.Linear(dim, hidden), nn.Linear(dim, hidden)
        self.down_proj = nn.Linear(hidden, dim)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))

def rotate_half(x):
    return torch.cat((-x[..., x.shape[-1] // 2:], x[..., : x.shape[-1] // 2]), dim=-1)

def apply_rotary_pos_emb(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin

class Block(nn.Module):
    def __init__(self, dim=16):
        super().__init__()
        self.norm, self.mlp = RMSNorm(dim), FeedForward(dim, 32)

    def forward(self, x, cos, sin):
        h = self.mlp(self.norm(x)).unsqueeze(1)
        q, k = apply_rotary_pos_emb(h, h, cos, sin)
        return (q * k).sum(-1)

def evaluate(model, x, cos, sin):
    with torch.no_grad():
        return model(x, cos, sin)

torch.manual_seed(0)
model = Block()
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x, cos, sin = torch.randn(2, 6, 16), torch.randn(2, 6, 16), torch.randn(2, 6, 16)
for _ in range(4):
    loss = model(x, cos, sin).tanh().mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
wrappers = [RMSNorm.__dict__["forward"], FeedForward.__dict__["forward"], apply_rotary_pos_emb]
print("wrapped", all(getattr(w, "__rtxops_wrapper__", False) for w in wrappers))
blob = cloudpickle.dumps((evaluate, model, apply_rotary_pos_emb, (x, cos, sin), evaluate(model, x, cos, sin)))
open(sys.argv[1], "wb").write(blob)
'''

WORKER = '''
import pickle, sys, torch
evaluate, model, rope, (x, cos, sin), expected = pickle.load(open(sys.argv[1], "rb"))
torch.testing.assert_close(evaluate(model, x, cos, sin), expected, rtol=0, atol=0)
model(x, cos, sin).tanh().mean().backward()
assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())
q, k = rope(x.unsqueeze(1), x.unsqueeze(1), cos, sin)
torch.testing.assert_close(q, rope.__wrapped__(x.unsqueeze(1), x.unsqueeze(1), cos, sin)[0])
from rtxops.runtime import patching
assert patching.active() is None
print("worker ok")
'''


def test_main_classes_and_functions_cloudpickled_by_a_job_run_as_written_elsewhere(tmp_path):
    (tmp_path / "driver.py").write_text(textwrap.dedent(DRIVER))
    (tmp_path / "worker.py").write_text(textwrap.dedent(WORKER))
    blob = tmp_path / "model.pkl"
    env = {k: v for k, v in os.environ.items() if not k.startswith("RTXOPS_")}
    env.update(RTXOPS_HOME=str(tmp_path / "home"), RTXOPS_REROUTE_MLP="1")  # the MLP routes too
    r = subprocess.run([sys.executable, "-m", "rtxops.cli", "run", "--direct", "--no-summary", "--",
                        sys.executable, str(tmp_path / "driver.py"), str(blob)],
                       capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr
    assert "wrapped True" in r.stdout  # rtxops' wrappers stood in for all three when pickled
    # the wrappers' closures went as stand-ins: not the dispatcher, not the call buffer (MBs)
    assert blob.stat().st_size < 100_000
    w = subprocess.run([sys.executable, str(tmp_path / "worker.py"), str(blob)],
                       capture_output=True, text=True, timeout=300, env=env)
    assert w.returncode == 0, w.stderr
    assert "worker ok" in w.stdout
