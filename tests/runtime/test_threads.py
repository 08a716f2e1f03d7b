"""Routed ops called from several threads while routes are added and replaced."""
from __future__ import annotations

import sys
import threading

import torch
import torch.nn.functional as F
from torch import nn

from rtxops.runtime import patching

from .._bounded import joined


def test_a_training_thread_and_a_thread_of_new_shapes_share_the_routes():
    """Each new shape on one thread adds a route while the training thread's backward sampling
    (every 8th step) replaces its routes: neither may see the other's change mid-iteration."""
    errors, stop = [], threading.Event()

    def new_shapes():
        try:
            rows = 1
            while not stop.is_set():
                F.softmax(torch.randn(rows % 5000 + 1, 3), -1)
                rows += 1
        except Exception as e:  # noqa: BLE001 - the test reports it
            errors.append(f"side: {type(e).__name__}: {e}")

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # threads switch as often as they can
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    patching.enable()
    side = threading.Thread(target=new_shapes)
    side.start()
    try:
        w = nn.Parameter(torch.randn(3, 3))
        opt = torch.optim.SGD([w], lr=0.01)
        for _ in range(400):
            F.softmax(torch.randn(2, 3) @ w, -1).sum().backward()
            opt.step()
            opt.zero_grad()
    except Exception as e:  # noqa: BLE001
        errors.append(f"train: {type(e).__name__}: {e}")
    finally:
        stop.set()
        joined(side)
        sys.setswitchinterval(interval)
        torch.set_num_threads(threads)
        patching.disable()
    assert errors == []
