"""Captured forwards and steps: one CUDA graph per fixed-shape forward, or decoding step, of one model and role,
bounded, on the model's device.

:class:`CapturedForwards` holds the graphs of one model in one role (target or drafter) of the static runtime
(:mod:`hf_dllm_spec.runtime.static`): a least-recently-used table `key -> graph` of at most `max_graphs` entries,
one private memory pool shared by them, and the record of a failed capture. PyTorch's whole-network recipe:
three warm-up runs on a side stream, then `torch.cuda.graph` capture; every replay copies the new inputs into the
graph's static buffers first. What it captures is a function of tensors: a forward (one output tensor) or a whole
decoding step, forward and maths (a tuple of output tensors; :meth:`~hf_dllm_spec.runtime.static.StaticModelRunner.
run_step`). Warm-up and capture run under :func:`hf_dllm_spec.tracing.recording`, so the code recorded takes its
recordable way (no Python caches of tensors, no host reads).

What keeps it safe in real programs (issue 32):

- **The model's device.** Warm-up, capture and replay run under `torch.cuda.device(model device)`
  (:func:`device_guard`): `torch.cuda.graph` and its side stream use the *current* device, and a model on `cuda:1`
  captured from `cuda:0` records an empty graph whose replays return stale outputs (PyTorch only warns).
- **A checked first replay.** Right after a capture the graph is replayed once on the same inputs and its output
  compared with the last warm-up's (:data:`CHECK_RTOL`): a graph that does not reproduce its eager forward
  (bitsandbytes 4-bit layers, bitsandbytes#1308) is dropped, and the model runs eager forwards with the reason.
- **Failures clean up and retry once.** A capture that raises (a host sync inside the forward, out of memory,
  another thread touching CUDA) or does not reproduce its forward restores the thread's current stream (PyTorch
  leaves the capture stream current when `capture_end()` raises inside the stream context), ends the allocator's
  routing to the private pool and releases the pool; the call goes on with eager forwards (the warm-up's output is
  the forward's result), the next call tries once more, and after :data:`MAX_ATTEMPTS` failures the model stays
  eager until the state is cleared (`clear_static_state(model)`). :meth:`CapturedForwards.note` says which,
  with the reason, for `spec_stats.runtime`.
- **Bounded.** At most `max_graphs` graphs (least recently replayed go first); their memory lives in the one pool,
  so it is bounded by the graphs kept. Graphs never run concurrently (one `generate` at a time per model:
  :func:`hf_dllm_spec.runtime.static.hold_static_runtime`) and every output is copied out right after its replay,
  which is what makes one shared pool safe.
- **Not tied to the first call's autograd mode.** The static buffers are created outside `torch.inference_mode`.

Source: PyTorch "CUDA Graphs" (whole-network capture, graph memory management, `capture_error_mode`);
`shared/reference/platform.md` ("CUDA graphs: what breaks a capture"); bitsandbytes#1308.
"""

from __future__ import annotations

import contextlib
import logging
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from ..tracing import recording

logger = logging.getLogger(__name__)

#: Captured graphs kept per model and role by default (least recently used go first past it).
DEFAULT_MAX_GRAPHS = 64
#: Failed captures after which a model and role stay eager until their static state is cleared.
MAX_ATTEMPTS = 2
#: Relative and absolute tolerance of the first replay against its eager warm-up (float32 logits).
CHECK_RTOL = 1e-2


def device_guard(device: torch.device):
    """`torch.cuda.device(device)` for a CUDA device (capture, warm-up and replay then use the model's device, not
    the thread's current one), else a no-op context."""
    if device.type == "cuda":
        return torch.cuda.device(device)
    return contextlib.nullcontext()


@dataclass
class CaptureFailure:
    """Why capturing failed, how many times, and in which call (:meth:`CapturedForwards.begin_call`)."""

    reason: str
    attempts: int
    call: int


#: What a captured function returns: a tensor, or a tuple of tensors (None entries allowed).
Outputs = torch.Tensor | tuple


@dataclass
class _Graph:
    replay: Callable[[], None]
    buffers: list[torch.Tensor]
    output: Outputs
    #: live rows n -> (the buffers' views the inputs go to, the padding rows to zero, the outputs' first n rows)
    views: dict[int, tuple[list, list, Outputs]] = field(default_factory=dict)

    def row_views(self, n: int, padded: Sequence[bool]) -> tuple[list, list, Outputs]:
        """The views of a batch of `n` live rows padded to the buffers' rows (made once per n: the buffers and
        outputs keep their addresses)."""
        if n not in self.views:
            targets = [b[:n] if pad else b for b, pad in zip(self.buffers, padded)]
            tails = [b[n:] for b, pad in zip(self.buffers, padded) if pad]
            self.views[n] = (targets, tails, _first_rows(self.output, n))
        return self.views[n]


def copy_many(targets: Sequence[torch.Tensor], sources: Sequence[torch.Tensor]) -> None:
    """`targets[i].copy_(sources[i])` for every i, in one `torch._foreach_copy_` per pair of dtypes: on a GPU one
    kernel launch for each group whose pairs share sizes and strides and are dense (PyTorch copies the other groups
    tensor by tensor), where a loop of `copy_` launches one kernel per tensor. Around a replayed graph these
    copies are most of what the host launches (docs/performance.md, "Around captured steps")."""
    groups: dict[tuple, tuple[list, list]] = {}
    for target, source in zip(targets, sources):
        group = groups.setdefault((target.dtype, source.dtype), ([], []))
        group[0].append(target)
        group[1].append(source)
    for group_targets, group_sources in groups.values():
        torch._foreach_copy_(group_targets, group_sources)


def fresh_copies(tensors: Sequence[torch.Tensor | None]) -> tuple:
    """New tensors equal to `tensors` (None entries kept), copied with :func:`copy_many` (one launch per dtype on a
    GPU, not one per tensor)."""
    fresh = [None if t is None else torch.empty_like(t) for t in tensors]
    copy_many([t for t in fresh if t is not None], [t for t in tensors if t is not None])
    return tuple(fresh)


def with_zero_rows(tensor: torch.Tensor, rows: int) -> torch.Tensor:
    """A new `(rows, ...)` tensor: `tensor` `(n, ...)` then `rows - n` rows of zeros."""
    return torch.cat([tensor, tensor.new_zeros(rows - tensor.shape[0], *tensor.shape[1:])])


def _first_rows(output: Outputs, n: int) -> Outputs:
    """The first `n` rows of an output (a tensor or a tuple of tensors / None), as views."""
    if isinstance(output, torch.Tensor):
        return output[:n]
    return tuple(None if t is None else t[:n] for t in output)


def _copy(output: Outputs) -> Outputs:
    """A fresh copy of a graph's output (a tensor or a tuple of tensors): the next replay overwrites the graph's."""
    if isinstance(output, torch.Tensor):
        return output.clone()
    return fresh_copies(output)


def _mismatch(replayed: Outputs, eager: Outputs) -> str | None:
    """Why a first replay's output differs from its eager warm-up's (floating tensors within :data:`CHECK_RTOL`,
    the others equal), or None."""
    pairs = [(replayed, eager)] if isinstance(eager, torch.Tensor) else list(zip(replayed, eager))
    for i, (a, b) in enumerate(pairs):
        if a is None:
            continue
        if a.is_floating_point():
            if not torch.allclose(a, b, rtol=CHECK_RTOL, atol=CHECK_RTOL, equal_nan=True):
                return f"output {i}: max |diff| {(a - b).abs().max().item():.3g}"
        elif not torch.equal(a, b):
            return f"output {i}: {int((a != b).sum())} entries differ"
    return None


class GraphMismatch(RuntimeError):
    """A captured graph's first replay differs from the eager forward it was captured from."""


class CapturedForwards:
    """The captured forwards of one model in one role: a bounded LRU table of CUDA graphs, their memory pool and
    the record of a failed capture.

    Args:
        device (`torch.device`): the model's execution device; every warm-up, capture and replay runs under it.
        max_graphs (`int`, defaults to :data:`DEFAULT_MAX_GRAPHS`): graphs kept; the least recently used goes first.

    Attributes:
        captures (`int`): graphs captured so far; `evictions` (`int`): graphs dropped for the bound;
        failure (:class:`CaptureFailure` or None).
    """

    WARMUP_RUNS = 3

    def __init__(self, device: torch.device, max_graphs: int = DEFAULT_MAX_GRAPHS) -> None:
        self.device = torch.device(device)
        self.max_graphs = max_graphs
        self.graphs: OrderedDict[tuple, _Graph] = OrderedDict()
        self.pool = None
        self.captures = 0
        self.evictions = 0
        self.failure: CaptureFailure | None = None
        self._calls = 0

    # -- calls and failures --------------------------------------------------------------------------------------
    def begin_call(self) -> int:
        """Number a new `generate` call (a failed capture is retried on a later call, never within its own)."""
        self._calls += 1
        return self._calls

    def may_capture(self, call: int) -> bool:
        """Whether `call` may capture a new graph: no failure yet, or one failure in an earlier call."""
        failure = self.failure
        return failure is None or (failure.attempts < MAX_ATTEMPTS and failure.call != call)

    def note(self, call: int) -> str:
        """What `spec_stats.runtime` says of capture failures for `call` ("" when none)."""
        failure = self.failure
        if failure is None:
            return ""
        if failure.attempts >= MAX_ATTEMPTS:
            return (f"CUDA graph capture failed {failure.attempts} times ({failure.reason}): eager forwards until "
                    "`clear_static_state(model)`")
        if failure.call == call:
            return f"CUDA graph capture failed ({failure.reason}): eager forwards in this call, retried once later"
        return f"an earlier CUDA graph capture failed ({failure.reason}); retried in this call"

    def bound(self, max_graphs: int) -> None:
        """Keep at most `max_graphs` graphs from now on, dropping the least recently used ones past it."""
        self.max_graphs = max_graphs
        while len(self.graphs) > max_graphs:
            self.graphs.popitem(last=False)
            self.evictions += 1

    def clear(self) -> None:
        """Drop every graph and the pool (the buffers they were captured against are gone); keep the failures."""
        self.graphs.clear()
        self.pool = None

    # -- running -------------------------------------------------------------------------------------------------
    def run(self, key: tuple, run_forward: Callable[..., Outputs], inputs: Sequence[torch.Tensor],
            bind: Callable[[list[torch.Tensor]], None], call: int, *, padded: Sequence[bool] | None = None,
            rows: int = 0) -> Outputs | None:
        """Replay the graph of `key` on `inputs`, or capture it the first time; None when `call` may not capture
        (the caller then runs the forward eagerly).

        Args:
            key (`tuple`): the forward's fixed shapes (a step's: its owner's key too).
            run_forward: `run_forward(*buffers) -> Tensor` or a tuple of tensors, the forward (or step) on static
                buffers: a function of them, the model's weights and the static cache only (what it reads besides
                is replayed from the address it had at capture), with no host read and no random draw.
            inputs: the forward's tensors, copied into the graph's buffers of the same shapes.
            bind: `bind(buffers)` points whatever the forward reads besides its arguments at the buffers (the
                cache's write columns).
            call (`int`): the number :meth:`begin_call` gave this `generate` call.
            padded (`Sequence[bool]`, *optional*), rows (`int`): a batch padded to `rows` rows: the inputs marked
                True hold only the first rows of their buffers (`(n, ...)` for a buffer of `(rows, ...)`); the other
                rows of those buffers are zeros, at capture and at every replay (the padding rows of a step whose
                batch is below its rows bucket, :meth:`~hf_dllm_spec.runtime.static.StaticModelRunner.run_step`:
                copied into the buffers' first rows, no padded tensor made on the host); the outputs, `(rows, ...)`
                each, come back cut to their first n rows.

        Returns:
            A fresh copy of the forward's output (tensor or tuple; with `padded`, each output's first n rows), or
            None.

        Raises:
            Whatever the eager warm-up forward raises (a capture failure itself is recorded, not raised).
        """
        entry = self.graphs.get(key)
        live = rows if not padded else next((value.shape[0] for value, pad in zip(inputs, padded) if pad), rows)
        if entry is not None:
            self.graphs.move_to_end(key)
            with device_guard(self.device):
                output = entry.output
                if padded is None:
                    copy_many(entry.buffers, inputs)
                else:       # the live rows into the buffers' first rows; the padding rows back to zeros
                    targets, tails, output = entry.row_views(live, padded)
                    copy_many(targets, inputs)
                    if tails:
                        torch._foreach_zero_(tails)
                bind(entry.buffers)
                entry.replay()
                return _copy(output)
        if not self.may_capture(call):
            return None
        # State kept across calls is never an inference tensor (buffers, the graph's output), whatever the autograd
        # mode of the call that captures; `inference_mode(False)` alone would turn gradients back on.
        with torch.inference_mode(False), torch.no_grad(), device_guard(self.device), recording():
            buffers = [with_zero_rows(value, rows) if pad else value.clone()
                       for value, pad in zip(inputs, padded or [False] * len(inputs))]
            bind(buffers)
            out = self._warm_up(run_forward, buffers)
            try:
                replay, output = self._capture(run_forward, buffers)
                replay()
                if (why := _mismatch(output, out)) is not None:
                    raise GraphMismatch(f"the replayed graph differs from its eager run ({why})")
            except (RuntimeError, torch.OutOfMemoryError) as error:
                self._fail(error, call)
                return _copy(out if padded is None else _first_rows(out, live))
        self.graphs[key] = _Graph(replay, buffers, output)
        self.captures += 1
        self.bound(self.max_graphs)
        return _copy(out if padded is None else _first_rows(out, live))

    def _fail(self, error: BaseException, call: int) -> None:
        """Record a failed capture, drop the graphs and the pool (the allocator may still route to it)."""
        attempts = self.failure.attempts + 1 if self.failure is not None else 1
        lines = str(error).strip().splitlines() or [type(error).__name__]
        self.failure = CaptureFailure(lines[0][:160], attempts, call)
        logger.warning("hf_dllm_spec: CUDA graph capture failed on %s (%s); %s", self.device, self.failure.reason,
                       "eager forwards for this call" if attempts < MAX_ATTEMPTS else "eager from now on")
        _release_pool(self.device, self.pool)
        self.clear()

    def _warm_up(self, run_forward, buffers: list[torch.Tensor]) -> torch.Tensor:
        """:attr:`WARMUP_RUNS` real forwards on a side stream of the model's device; the last output."""
        stream = torch.cuda.Stream(device=self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(self.WARMUP_RUNS):
                out = run_forward(*buffers)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        return out

    def _capture(self, run_forward, buffers: list[torch.Tensor]):
        """Capture `run_forward(*buffers)` into the pool; returns `(replay, static output)`. On any error the
        thread's current stream is put back before the error goes on."""
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.current_stream(self.device)
        try:
            with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
                output = run_forward(*buffers)
        except BaseException:
            torch.cuda.set_stream(stream)
            raise
        return graph.replay, output


def _release_pool(device: torch.device, pool) -> None:
    """End the caching allocator's routing of this thread's allocations to `pool` and release it (what
    `capture_end()` does, skipped when it raised). Private PyTorch calls, absent on some builds: best effort."""
    if pool is None or device.type != "cuda":
        return
    index = device.index if device.index is not None else torch.cuda.current_device()
    for name in ("_cuda_endAllocateToPool", "_cuda_releasePool"):
        function = getattr(torch._C, name, None)
        if function is not None:
            with contextlib.suppress(RuntimeError):
                function(index, pool)
    with contextlib.suppress(RuntimeError):
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


__all__ = ["CaptureFailure", "CapturedForwards", "DEFAULT_MAX_GRAPHS", "GraphMismatch", "MAX_ATTEMPTS",
           "copy_many", "device_guard", "fresh_copies", "with_zero_rows"]
