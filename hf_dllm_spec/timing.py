"""Wall-clock helper: `time.perf_counter()` after synchronising the device (metrics.md §3)."""

from __future__ import annotations

import time

import torch


def now(device: torch.device) -> float:
    """Seconds from `time.perf_counter()`, after `torch.cuda.synchronize` on CUDA devices."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()
