"""Counting host synchronisations: the tensor operations that make the host wait for the device.

A CUDA graph cannot capture a forward that reads a device value on the host (capture fails), and every such read
between two forwards stalls the host until the device has finished all queued work, so the next launch waits. On
the CPU nothing waits, but the same operations are there: counting them on the CPU shows, before any GPU run,
whether a forward can be captured (zero inside it) and how many times a decoding step would wait
(`tests/test_static_runtime.py`).

>>> with count_host_syncs() as syncs:                                                    # doctest: +SKIP
...     model.generate(ids, decoding_strategy="s2d2", cache_implementation="static")
>>> syncs.total, syncs.by_site.most_common(3)                                            # doctest: +SKIP

Counted (each call once): `Tensor.item`, `tolist`, `bool(t)`, `int(t)`, `float(t)`, `t.__index__`, `nonzero`,
`argwhere`, `masked_select`, `unique`, `cpu`, `numpy`, and indexing with a boolean tensor (its output size depends
on the values). Not counted: copies the host does not wait for (host to device), and synchronisations transformers
or torch make without a tensor operation (`torch.cuda.synchronize`).

Source: PyTorch "CUDA Graphs" (constraints: no CPU synchronisation inside a captured region);
`torch.overrides.TorchFunctionMode`.
"""

from __future__ import annotations

import contextlib
import traceback
from collections import Counter
from typing import Iterator

import torch
from torch.overrides import TorchFunctionMode

#: Tensor operations whose result the host must wait for.
SYNC_OPERATIONS = frozenset({"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "nonzero", "argwhere",
                             "masked_select", "unique", "cpu", "numpy"})
#: Source folders whose frames name a synchronisation's site (the innermost one of these on the stack).
SITE_PACKAGES = ("hf_dllm_spec", "model_patches")


def _boolean_index(args: tuple) -> bool:
    if len(args) < 2:
        return False
    index = args[1] if isinstance(args[1], tuple) else (args[1],)
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in index)


class HostSyncCounter(TorchFunctionMode):
    """A `TorchFunctionMode` that counts the synchronising tensor operations run while it is active.

    Attributes:
        total (`int`): synchronisations counted.
        by_operation (`Counter[str]`): per operation name ("tolist", "__bool__", "boolean index", ...).
        by_site (`Counter[tuple[str, int]]`): per `(file, line)` of the innermost frame inside this project's
            packages (`("<outside>", 0)` when none is on the stack).
    """

    def __init__(self) -> None:
        super().__init__()
        self.total = 0
        self.by_operation: Counter[str] = Counter()
        self.by_site: Counter[tuple[str, int]] = Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name == "__getitem__" and _boolean_index(args):
            name = "boolean index"
        elif name not in SYNC_OPERATIONS:
            return func(*args, **(kwargs or {}))
        self.total += 1
        self.by_operation[name] += 1
        self.by_site[_site()] += 1
        return func(*args, **(kwargs or {}))


def _site() -> tuple[str, int]:
    for frame in reversed(traceback.extract_stack(limit=40)):
        if frame.filename == __file__:
            continue
        parts = frame.filename.replace("\\", "/").split("/")
        for package in SITE_PACKAGES:
            if package in parts[:-1]:
                return "/".join(parts[parts.index(package):]), frame.lineno
    return "<outside>", 0


@contextlib.contextmanager
def count_host_syncs() -> Iterator[HostSyncCounter]:
    """Count the host synchronisations of the tensor operations run in the block (this thread).

    Yields:
        :class:`HostSyncCounter`: `total`, `by_operation`, `by_site`.
    """
    counter = HostSyncCounter()
    with counter:
        yield counter


__all__ = ["HostSyncCounter", "SYNC_OPERATIONS", "count_host_syncs"]
