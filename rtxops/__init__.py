"""rtxops: a self-optimizing execution runtime for PyTorch training jobs."""
from __future__ import annotations

__version__ = "0.1.0"
