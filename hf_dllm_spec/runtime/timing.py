"""Timing without device syncs on the hot path (CUDA events, not host time alone, on the GPU).

`now` synchronises (for the call as a whole). `ForwardTimer` times individual forwards: on CPU with
`time.perf_counter()`, on CUDA with events recorded on the stream and read once, at :meth:`ForwardTimer.total`,
so the decoding loop never waits for the device to measure itself.
"""

from __future__ import annotations

import time

import torch


def now(device: torch.device) -> float:
    """Seconds from `time.perf_counter()`, after `torch.cuda.synchronize` on CUDA devices."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


class ForwardTimer:
    """Accumulates the duration of timed spans, in seconds, without synchronising CUDA per span.

    >>> timer = ForwardTimer(torch.device("cpu"))
    >>> with timer.span("forward"):
    ...     _ = torch.ones(2) + 1
    >>> timer.total("forward") >= 0.0
    True
    """

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self._seconds: dict[str, float] = {}
        self._events: dict[str, list[tuple[torch.cuda.Event, torch.cuda.Event]]] = {}

    def span(self, name: str) -> "_Span":
        """Context manager timing one span under `name` (e.g. "forward", "prefill")."""
        return _Span(self, name)

    def total(self, name: str) -> float:
        """Seconds spent in spans called `name` (one CUDA sync here, if any events are pending)."""
        pending = self._events.pop(name, [])
        if pending:
            pending[-1][1].synchronize()
            self._seconds[name] = self._seconds.get(name, 0.0) + sum(a.elapsed_time(b) for a, b in pending) / 1e3
        return self._seconds.get(name, 0.0)


class _Span:
    def __init__(self, timer: ForwardTimer, name: str) -> None:
        self.timer, self.name = timer, name

    def __enter__(self) -> "_Span":
        if self.timer.cuda:
            self.start = torch.cuda.Event(enable_timing=True)
            self.start.record()
        else:
            self.start = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        timer = self.timer
        if timer.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            timer._events.setdefault(self.name, []).append((self.start, end))
        else:
            timer._seconds[self.name] = timer._seconds.get(self.name, 0.0) + time.perf_counter() - self.start
