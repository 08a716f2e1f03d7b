"""Gradients by autograd through an op's math, for a backward that cannot give its own."""
from __future__ import annotations

from typing import Any, Callable, Sequence

import torch


def reference_grads(reference: Callable[..., Any], inputs: Sequence[Any],
                    grad_outputs: Sequence[torch.Tensor], needs: Sequence[bool]) -> list:
    """The gradients of ``reference(*inputs)`` for the inputs ``needs`` marks (None for the
    others), made by autograd. A kernel's backward answers with these when its own would be
    wrong: under ``create_graph`` (a gradient penalty differentiates the gradient, which the
    kernels' buffers would hand over as constants) or when a retained graph runs it again.
    ``inputs`` must be the tensors the function was applied to (saved with
    ``save_for_backward``), so that the gradients reach back through their graphs."""
    create = torch.is_grad_enabled()
    wanted = [i for i, (t, need) in enumerate(zip(inputs, needs))
              if need and isinstance(t, torch.Tensor) and t.requires_grad]
    grads: list = [None] * len(inputs)
    if not wanted:
        return grads
    with torch.enable_grad():
        out = reference(*inputs)
        outs = [out] if isinstance(out, torch.Tensor) else list(out)
        pairs = [(o, g) for o, g in zip(outs, grad_outputs) if g is not None and o.requires_grad]
        got = torch.autograd.grad([o for o, _ in pairs], [inputs[i] for i in wanted],
                                  [g for _, g in pairs], create_graph=create, allow_unused=True)
    for i, g in zip(wanted, got):
        grads[i] = g
    return grads
