"""A per-forward trace the runtime offers: what each forward was (kind, width, context length) and its time.

Benchmarks and the cost model read what the decoding loop ran from here, not by inspecting stack frames:

>>> with trace_forwards() as trace:                                                      # doctest: +SKIP
...     model.generate(ids, decoding_strategy="s2d2", max_new_tokens=32)
>>> [(r.kind, r.width, r.context) for r in trace.records][:2]                            # doctest: +SKIP
[('prefill', 12, 0), ('draft', 4, 12)]

Tracing is off unless a :func:`trace_forwards` block is active in the calling thread (a context variable), and
then costs one small record per forward; timing (`timed=True`) adds CUDA events on the GPU, read once when the
block ends, so the loop never synchronises to time itself.
"""

from __future__ import annotations

import contextlib
import contextvars
import time
from dataclasses import dataclass, replace
from typing import Iterator

import torch


@dataclass(frozen=True)
class ForwardRecord:
    """One forward of one model over a batch.

    Attributes:
        role (`str`): "target", or "drafter" for a separate draft model (SimSD, DEER).
        kind (`str`): one of `hf_dllm_spec.outputs.FORWARD_KINDS` ("prefill", "draft", "verify", "cache_write").
        rows (`int`): N, the batch rows in the forward.
        width (`int`): q, query tokens per row (stored and read-only together).
        stored (`int`): the leading query tokens whose K/V persist (`store_len`).
        context (`int`): cached columns per row before the forward (padding included; 0 without a cache).
        keep (`int`): query rows whose logits the model computes (the `logits_to_keep` of the model call).
        seconds (`float` or `None`): duration of the model call in seconds when the trace is timed.
    """

    role: str
    kind: str
    rows: int
    width: int
    stored: int
    context: int
    keep: int
    seconds: float | None = None


class ForwardTrace:
    """The records of one :func:`trace_forwards` block, in forward order."""

    def __init__(self, timed: bool = False) -> None:
        self.timed = timed
        self._records: list[ForwardRecord] = []
        self._pending: list[tuple[int, torch.cuda.Event, torch.cuda.Event]] = []

    @property
    def records(self) -> list[ForwardRecord]:
        """Every record so far (CUDA timings resolved here, with one synchronisation if any are pending)."""
        if self._pending:
            self._pending[-1][2].synchronize()
            for index, start, end in self._pending:
                self._records[index] = replace(self._records[index], seconds=start.elapsed_time(end) / 1e3)
            self._pending.clear()
        return list(self._records)

    @contextlib.contextmanager
    def forward(self, record: ForwardRecord, device: torch.device) -> Iterator[None]:
        """Time (when `timed`) and append `record` around one model call on `device`."""
        if not self.timed:
            self._records.append(record)
            yield
        elif device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self._pending.append((len(self._records), start, end))
            self._records.append(record)
        else:
            began = time.perf_counter()
            yield
            self._records.append(replace(record, seconds=time.perf_counter() - began))


_ACTIVE: contextvars.ContextVar[ForwardTrace | None] = contextvars.ContextVar("hf_dllm_spec_trace", default=None)


def active_trace() -> ForwardTrace | None:
    """The trace of the innermost active :func:`trace_forwards` block of this thread, else None."""
    return _ACTIVE.get()


@contextlib.contextmanager
def trace_forwards(timed: bool = False) -> Iterator[ForwardTrace]:
    """Record every forward the library's runtime runs inside the block (all models, all `generate` calls).

    Args:
        timed (`bool`, defaults to False): also time each model call (`time.perf_counter` on the CPU, CUDA events
            on the GPU).

    Yields:
        `ForwardTrace`: read `.records` inside or after the block.
    """
    trace = ForwardTrace(timed)
    token = _ACTIVE.set(trace)
    try:
        yield trace
    finally:
        _ACTIVE.reset(token)
