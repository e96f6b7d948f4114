"""The request queue of the server: concurrent requests decoded together in the library's padded batches.

One worker thread owns the model. Requests wait in a queue while a batch decodes; when it ends, the worker takes
the oldest waiting request and every other waiting request with the same decoding options
(:attr:`~hf_dllm_spec.serving.protocol.DecodingOptions.batch_key`), up to `max_batch_size`, and decodes them with
one `model.generate` call: prompts left-padded, `max_new_tokens` the largest budget of the batch. A row leaves the
batch when it finishes (the library drops finished rows from its forwards), at its stop id, at its own budget or
when its client goes away.

Per-row budgets, streaming and cancellation ride on `generate`'s stopping criteria, which the library calls on the
whole batch once every row's token t is final (:class:`RowStreams`): each row's tokens are streamed as they
become final (never a token a later step could revise), and a criterion that fires ends the row there. A row's
tokens do not depend on the other rows of its batch (the library's batch == one by one property; a sampled row
draws from its own seeded generator, `generate(generator=[g_0, g_1, ...])`), so a request gets the tokens of its
own batch-1 `generate` call.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import threading
import time
import traceback
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import StoppingCriteria, StoppingCriteriaList

import model_patches

from ..maths.masks import left_pad
from ..runtime.placement import execution_device
from ..strategies.registry import get_strategy
from .protocol import ParsedRequest, server_terms

_ids = itertools.count()


@dataclass
class Result:
    """A finished request: its new tokens, why it ended and the library's statistics of its row."""

    tokens: list[int]
    finish_reason: str            # "stop" (a stop id) or "length" (the budget)
    stats: dict[str, Any]


@dataclass
class Job:
    """One request in flight. The worker thread posts `(kind, payload)` events to `events` on the request's event
    loop: `("tokens", [ids])` as tokens become final, then `("done", Result)` or `("error", (status, message))`.
    Setting `cancelled` (the client went away) ends the row at its next final token. `observer` (the server's
    :class:`~hf_dllm_spec.serving.metrics.ServerMetrics`, set by :meth:`Batcher.submit`) sees every event."""

    request: ParsedRequest
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    id: str = field(default_factory=lambda: f"cmpl-{next(_ids)}-{random.getrandbits(32):08x}")
    created: float = field(default_factory=time.monotonic)
    observer: Any = None
    tokens_sent: int = 0

    def emit(self, kind: str, payload: Any) -> None:
        if self.observer is not None:
            self._observe(kind, payload)
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, payload))
        except RuntimeError:          # the event loop is closed: nobody listens any more
            self.cancelled.set()

    def _observe(self, kind: str, payload: Any) -> None:
        strategy, waited = self.request.options.decoding_strategy, time.monotonic() - self.created
        if kind == "tokens" and payload:
            self.observer.tokens(strategy, len(payload), self.tokens_sent == 0, waited)
            self.tokens_sent += len(payload)
        elif kind == "done":
            self.observer.done(strategy, payload.finish_reason, len(self.request.prompt_ids), len(payload.tokens),
                               payload.stats, waited)
        elif kind == "error":
            self.observer.error(payload[0])


def row_stats(stats, decoding_strategy: str, batch_size: int) -> dict[str, Any]:
    """The library's statistics of one row (`SpecDecodingStats`) for a response's `dllm_stats` field: NFE (the
    forwards the row took part in), tokens per forward, acceptance rate and mean acceptance length (None without
    drafts), the rows its batch started with."""
    drafts = stats.num_draft_tokens > 0
    return {"decoding_strategy": decoding_strategy, "nfe": stats.nfe, "tokens_per_forward": stats.tpf,
            "acceptance_rate": stats.acceptance_rate if drafts else None,
            "mean_acceptance_length": stats.mean_acceptance_length if stats.num_drafts else None,
            "num_drafts": stats.num_drafts, "num_draft_tokens": stats.num_draft_tokens,
            "num_accepted_tokens": stats.num_accepted_tokens, "batch_size": batch_size,
            "wall_time_s": stats.wall_time_s}


class RowStreams(StoppingCriteria):
    """Stopping criterion that streams each row's final tokens and ends rows at their own budget or cancellation.

    The library evaluates stopping criteria position by position on the whole batch, `(N, P + t)`, once every
    row's token t is final or the row has ended (rows that ended are continued with padding). Position t of row n
    is streamed to its job unless the row has already ended (a stop id, its budget, its cancellation).

    Args:
        jobs (`list[Job]`): the batch's requests, in row order.
        prompt_width (`int`): P, the padded prompt width.
        stop_ids (`list[int]`): the stop ids `generate` uses (a row ends after the first one, kept).
    """

    def __init__(self, jobs: list[Job], prompt_width: int, stop_ids: list[int]) -> None:
        self.jobs, self.width, self.stop_ids = jobs, prompt_width, set(stop_ids)
        self.sent = [0] * len(jobs)
        self.closed = [False] * len(jobs)
        self.by_streamer = [False] * len(jobs)

    def streamer(self, n: int) -> "_DraftStreamer":
        """A streamer for row `n` (batch 1: `generate`'s `streamer`) that takes over its streaming: final tokens
        from `put` (as soon as they are final, also inside a block) and drafts from `put_draft`, posted as
        `("draft", [ids])` events; the criterion then only ends the row."""
        self.by_streamer[n] = True
        return _DraftStreamer(self, n)

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
        t = input_ids.shape[1] - self.width
        last = input_ids[:, -1].tolist()
        fired = []
        for n, job in enumerate(self.jobs):
            if not self.closed[n] and self.sent[n] == t - 1 and not self.by_streamer[n]:
                job.emit("tokens", [last[n]])
                self.sent[n] = t
                stopped = last[n] in self.stop_ids and not job.request.options.ignore_eos
                self.closed[n] = stopped or t >= job.request.max_tokens
            stop = t >= job.request.max_tokens or job.cancelled.is_set()
            self.closed[n] = self.closed[n] or stop
            fired.append(stop)
        return torch.tensor(fired, dtype=torch.bool, device=input_ids.device)


class _DraftStreamer:
    """transformers' `TextDiffusionStreamer` protocol for one job: `put` (the prompt first, then final tokens),
    `put_draft` (provisional tokens, `(1, k)`), `end`."""

    def __init__(self, streams: RowStreams, n: int) -> None:
        self.streams, self.n, self.prompt_seen = streams, n, False

    def put(self, value: torch.Tensor) -> None:
        if not self.prompt_seen:                 # `generate` puts the prompt first
            self.prompt_seen = True
            return
        ids = value.reshape(-1).tolist()
        self.streams.jobs[self.n].emit("tokens", ids)
        self.streams.sent[self.n] += len(ids)

    def put_draft(self, value: torch.Tensor) -> None:
        self.streams.jobs[self.n].emit("draft", value.reshape(-1).tolist())

    def end(self) -> None:
        pass


class Batcher:
    """The worker threads and their queue (see the module docstring).

    Args:
        model (`PreTrainedModel`): the target.
        drafter (`PreTrainedModel`, *optional*): passed as `draft_model` to the strategies that use one.
        max_batch_size (`int`, defaults to 16): most rows per `generate` call.
        observer (*optional*): given every job's events (the server's metrics).
        pad_token_id (`int`, *optional*): left padding of the prompts (default: the generation config's, else
            the first stop id).
        workers (`int`, defaults to 1): batches decoded at the same time (threads sharing the model; 1 with the
            static runtime).
        max_step_tokens (`int`, *optional*): most tokens one forward of a batch may hold, counted on its largest
            forward, the prefill: rows x longest prompt (the prompts are left-padded to it). A request is added to
            a batch only while the batch stays within it (a lone request over it is refused before it is queued).

    Raises:
        ValueError: `workers` < 1, or > 1 with `cache_implementation="static"` on the model's generation config.
    """

    def __init__(self, model, drafter=None, *, max_batch_size: int = 16, pad_token_id: int | None = None,
                 observer: Any = None, workers: int = 1, max_step_tokens: int | None = None) -> None:
        from ..integration.generate import dllm_generate
        from ..integration.mixin import DllmGenerationMixin

        from ..validation import invalid

        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
            raise invalid("workers", workers, "be an integer >= 1", "pass e.g. workers=2")
        if workers > 1 and getattr(model.generation_config, "cache_implementation", None) == "static":
            raise invalid("workers", workers, "be 1 with cache_implementation='static' (the static runtime keeps its "
                          "buffers on the model)", "pass workers=1 (--max-concurrent-batches 1), or the eager runtime")
        self.model, self.drafter, self.max_batch_size, self.observer = model, drafter, max_batch_size, observer
        self.max_step_tokens = max_step_tokens
        self.device = execution_device(model)
        self.stop_ids = list(model_patches.get_patch(model).stop_token_ids(model, model.generation_config))
        gc_pad = model.generation_config.pad_token_id
        self.pad_token_id = pad_token_id if pad_token_id is not None else (
            gc_pad if gc_pad is not None else (self.stop_ids[0] if self.stop_ids else 0))
        self.entry = {} if isinstance(model, DllmGenerationMixin) else {"custom_generate": dllm_generate}
        self.queue: deque[Job] = deque()
        self.cond = threading.Condition()
        self.running = 0
        self.counts = {"requests": 0, "batches": 0, "cancelled": 0, "errors": 0}
        self.batch_seconds: deque[float] = deque(maxlen=32)  # wall time of the last batches
        self.history: deque[dict] = deque(maxlen=1024)     # finished rows: id, tokens, reason, batch size
        self.closed = False
        self.threads = [threading.Thread(target=self._work, name=f"hf-dllm-spec-batcher-{k}", daemon=True)
                        for k in range(workers)]
        for thread in self.threads:
            thread.start()

    # -- the event-loop side ---------------------------------------------------------------------------------
    def submit(self, job: Job) -> None:
        job.observer = self.observer
        with self.cond:
            self.queue.append(job)
            self.counts["requests"] += 1
            self.cond.notify()

    def status(self) -> dict[str, Any]:
        with self.cond:
            return {"queued": len(self.queue), "running": self.running, **self.counts}

    def retry_after(self) -> int:
        """Seconds until the waiting requests are likely taken (the `Retry-After` of a 429): the mean wall time
        of the last batches times the batches the queue fills, at least 1."""
        with self.cond:
            mean = sum(self.batch_seconds) / len(self.batch_seconds) if self.batch_seconds else 1.0
            return max(1, round(mean * (1 + len(self.queue) // self.max_batch_size)))

    def close(self, timeout: float = 30.0) -> None:
        """Stop taking batches; the batches in progress finish first."""
        with self.cond:
            self.closed = True
            self.cond.notify_all()
        for thread in self.threads:
            thread.join(timeout)

    # -- the worker thread -----------------------------------------------------------------------------------
    def _take(self) -> list[Job]:
        with self.cond:
            while not self.closed and not self.queue:
                self.cond.wait()
            if self.closed:
                return []
            waiting = [j for j in self.queue if not j.cancelled.is_set()]
            self.counts["cancelled"] += len(self.queue) - len(waiting)
            if not waiting:
                self.queue.clear()
                return []
            key = waiting[0].request.options.batch_key
            batch = [j for j in waiting if j.request.options.batch_key == key and not j.request.stream_drafts]
            batch = [waiting[0]] if waiting[0].request.stream_drafts else self._fit(batch)
            taken = {id(j) for j in batch}
            self.queue = deque(j for j in waiting if id(j) not in taken)
            self.running += len(batch)
            return batch

    def _fit(self, group: list[Job]) -> list[Job]:
        """The oldest requests of a group that fit one batch: at most `max_batch_size` rows, and rows x longest
        prompt within `max_step_tokens` (the first request always: it was checked alone)."""
        batch, width = [], 0
        for job in group[: self.max_batch_size]:
            wider = max(width, len(job.request.prompt_ids))
            if batch and self.max_step_tokens is not None and (len(batch) + 1) * wider > self.max_step_tokens:
                continue
            batch.append(job)
            width = wider
        return batch

    def _count(self, name: str) -> None:
        with self.cond:
            self.counts[name] += 1

    def _work(self) -> None:
        while not self.closed:
            jobs = self._take()
            if not jobs:
                continue
            started = time.perf_counter()
            try:
                self._run(jobs)
            finally:
                with self.cond:
                    self.running -= len(jobs)
                    self.batch_seconds.append(time.perf_counter() - started)

    def _run(self, jobs: list[Job]) -> None:
        """Decode a batch; if the library refuses it (ValueError or NotImplementedError, before any forward), each
        request alone, so only the bad one gets the error (a budget that fits one prompt may not fit the batch's
        largest); the library's message is said in the server's terms (:func:`~.protocol.server_terms`)."""
        try:
            self._decode(jobs)
        except (ValueError, NotImplementedError) as err:
            if len(jobs) > 1:
                for job in jobs:
                    self._run([job])
                return
            self._count("errors")
            jobs[0].emit("error", (400, server_terms(str(err))))
        except Exception as err:                                  # noqa: BLE001 - reported to the client
            traceback.print_exc()
            for job in jobs:
                self._count("errors")
                job.emit("error", (500, f"{type(err).__name__}: {err}"))

    def _decode(self, jobs: list[Job]) -> None:
        options = jobs[0].request.options
        ids, valid, _ = left_pad([torch.tensor(j.request.prompt_ids, dtype=torch.long) for j in jobs])
        ids, mask, width = ids.masked_fill(~valid, self.pad_token_id), valid.long(), ids.shape[1]
        kwargs = options.generate_kwargs()
        if get_strategy(options.decoding_strategy).uses_drafter and self.drafter is not None:
            kwargs["draft_model"] = self.drafter
        if options.do_sample:             # one generator per row: a request's draws do not depend on its batch
            kwargs["generator"] = [torch.Generator(self.device).manual_seed(
                j.request.options.seed if j.request.options.seed is not None else random.getrandbits(63))
                for j in jobs]
        streams = RowStreams(jobs, width, self.stop_ids)
        if jobs[0].request.stream_drafts:            # batch 1: the library's streamer protocol, drafts included
            kwargs["streamer"] = streams.streamer(0)
        out = self.model.generate(ids.to(self.device), attention_mask=mask.to(self.device),
                                  max_new_tokens=max(j.request.max_tokens for j in jobs),
                                  pad_token_id=self.pad_token_id, return_dict_in_generate=True,
                                  stopping_criteria=StoppingCriteriaList([streams]), **self.entry, **kwargs)
        self._count("batches")
        for n, job in enumerate(jobs):
            stats = out.spec_stats_per_row[n]
            tokens = out.sequences[n, width:][: stats.num_generated_tokens].tolist()
            if streams.sent[n] < len(tokens):                  # not yet streamed (never expected): send the rest
                job.emit("tokens", tokens[streams.sent[n]:])
            stopped = tokens and tokens[-1] in self.stop_ids and not job.request.options.ignore_eos
            reason = "stop" if stopped else "length"
            if job.cancelled.is_set():
                self._count("cancelled")
                reason = "cancelled"
            self.history.append({"id": job.id, "tokens": len(tokens), "finish_reason": reason,
                                 "batch_size": len(jobs), "time": time.time()})
            job.emit("done", Result(tokens, reason, row_stats(stats, options.decoding_strategy, len(jobs))))
