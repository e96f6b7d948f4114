"""Whether the code running now is being recorded as a decoding step: traced by `torch.compile` or captured in a
CUDA graph (issue 34).

Recorded code runs once and is replayed: it may not read the device on the host, branch on a device value, keep
a tensor in a Python cache for a later call (a CUDA graph replays the addresses it recorded; a compiled graph would
guard on the cache) or, in a CUDA graph, copy a tensor from pageable host memory (`torch.tensor(list)`; PyTorch
refuses it during a capture). The few places that do such things outside a step ask :func:`recording_step` and take
the recordable way inside one; :func:`device_constant` builds small constants. :func:`recording` marks a CUDA
graph's warm-up and capture (:class:`~hf_dllm_spec.runtime.graphs.CapturedForwards`); `torch.compiler.is_compiling`
marks tracing.

Source: PyTorch "CUDA Graphs" (constraints of captured code); `torch.compiler.is_compiling`.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Sequence

import torch

_local = threading.local()


def recording_step() -> bool:
    """True while `torch.compile` traces the running code or a CUDA graph records it (:func:`recording`)."""
    return torch.compiler.is_compiling() or getattr(_local, "recording", False)


@contextlib.contextmanager
def recording():
    """Mark the code run inside as recorded into a CUDA graph (this thread only; nests)."""
    previous = getattr(_local, "recording", False)
    _local.recording = True
    try:
        yield
    finally:
        _local.recording = previous


def device_constant(values: Sequence[int | float | bool], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`torch.tensor(values, dtype=dtype, device=device)` `(len(values),)`; while a CUDA graph records
    (:func:`recording`), written on the device one entry at a time instead (a copy from pageable host memory is
    refused during a capture; a handful of one-element fills are recorded into the graph)."""
    if not getattr(_local, "recording", False):
        return torch.tensor(values, dtype=dtype, device=device)
    out = torch.empty(len(values), dtype=dtype, device=device)
    for i, value in enumerate(values):
        out[i].fill_(value)
    return out


__all__ = ["device_constant", "recording", "recording_step"]
