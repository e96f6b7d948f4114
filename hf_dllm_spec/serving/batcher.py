"""The request queue of the server: continuous batching over the library's `generate(row_feed=...)`.

One worker thread owns the model (more with `workers`, eager runtime only). When it is free it takes the oldest
waiting request and every other waiting request with the same decoding options
(:attr:`~hf_dllm_spec.serving.protocol.DecodingOptions.batch_key`: strategy, parameters, warpers), up to
`max_batch_size` rows and `max_step_tokens`, and starts one `model.generate` call with them. While that call runs,
requests of the same options join it at the strategy's next join point (between two denoising steps for the block
strategies, between two draft-and-verify cycles for SimSD and DEER: :mod:`hf_dllm_spec.integration.rows`), as
long as the oldest waiting request is of the same options: a request of other options is not passed over, the
running call stops taking rows, drains, and the other options run next (first come, first served between groups). A
row leaves the batch as soon as it ends (its own budget, its stop id) or its client goes away, and its row is free
for the next request.

Each row's final tokens are streamed as they become final (never a token a later step could revise). A row's
tokens do not depend on the other rows of its batch, nor on when it joined (the library's batch == one by one
property; a sampled row draws from its own seeded generator), so a request gets the tokens of its own batch-1
`generate` call. A request with `stream_drafts` runs alone (transformers' streamer protocol is batch 1).
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
from ..runtime.weights import execution_device
from ..strategies.registry import get_strategy
from ..integration.rows import RowFeed, RowRequest
from .protocol import ParsedRequest, server_error

_ids = itertools.count()
_SHUTTING_DOWN = "the server is shutting down and takes no more requests; retry on a running server"


@dataclass
class Result:
    """A finished request: its new tokens, why it ended and the library's statistics of its row."""

    tokens: list[int]
    finish_reason: str            # "stop" (a stop id), "length" (the budget) or "cancelled" (the client left)
    stats: dict[str, Any]


@dataclass
class Job:
    """One request in flight. The worker thread posts `(kind, payload)` events to `events` on the request's event
    loop: `("tokens", [ids])` as tokens become final, then `("done", Result)` or
    `("error", (status, message[, param]))`.
    Setting `cancelled` (the client went away) ends the row at the batch's next join point (a `stream_drafts` request,
    which runs alone, at its next final token). `observer` (the server's
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
        """Post the event `(kind, payload)` to `events` on the request's event loop (safe from the worker thread),
        after showing it to `observer`; when that loop is closed (nobody listens), set `cancelled` instead.

        Args:
            kind (`str`): "tokens", "draft", "done" or "error".
            payload: `list[int]` (tokens, draft), a :class:`Result` (done), or `(status, message[, param])`
                (error; `param`: the request field it is about).
        """
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


def _refusal(err: Exception, job: Job) -> tuple[int, str, str | None]:
    """The error event of a request the library refused: `(400, message, param)` in the server's terms."""
    refused = server_error(err, job.request.prompt_field)
    return 400, str(refused), refused.param


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
        max_batch_size (`int`, defaults to 32): most rows decoding together in one `generate` call.
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

    def __init__(self, model, drafter=None, *, max_batch_size: int = 32, pad_token_id: int | None = None,
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
    def submit(self, *jobs: Job) -> None:
        """Queue `jobs` together (a request's completions: a worker sees them all at once, so they start one batch
        where rows are free) and give them the batcher's `observer`; each counted in `counts["requests"]`. Each job
        starts a batch or joins a running one when a worker takes it. After :meth:`close` they get a 503 error event
        at once."""
        for job in jobs:
            job.observer = self.observer
        with self.cond:
            if not self.closed:
                self.queue.extend(jobs)
                self.counts["requests"] += len(jobs)
                self.cond.notify()
                return
        for job in jobs:
            job.emit("error", (503, _SHUTTING_DOWN))

    def status(self) -> dict[str, Any]:
        """A snapshot of the queue: "queued" (jobs waiting; cancelled ones are dropped here), "running" (rows taken
        by a worker and not yet done), and the counters "requests", "batches", "cancelled", "errors"."""
        with self.cond:
            return {"queued": len(self._waiting()), "running": self.running, **self.counts}

    def retry_after(self) -> int:
        """Seconds until the waiting requests are likely taken (the `Retry-After` of a 429): the mean wall time
        of the last batches times the batches the queue fills, at least 1."""
        with self.cond:
            mean = sum(self.batch_seconds) / len(self.batch_seconds) if self.batch_seconds else 1.0
            return max(1, round(mean * (1 + len(self.queue) // self.max_batch_size)))

    def close(self, timeout: float = 30.0) -> None:
        """Stop taking requests and batches: the waiting requests (and any submitted later) get a 503 error event;
        the batches in progress finish first (at most `timeout` seconds per worker thread)."""
        with self.cond:
            self.closed = True
            waiting, self.queue = list(self.queue), deque()
            self.cond.notify_all()
        for job in waiting:
            job.emit("error", (503, _SHUTTING_DOWN))
        for thread in self.threads:
            thread.join(timeout)

    # -- the worker thread -----------------------------------------------------------------------------------
    def _take(self) -> list[Job]:
        with self.cond:
            while not self.closed and not self.queue:
                self.cond.wait()
            if self.closed:
                return []
            waiting = self._waiting()
            if not waiting:
                return []
            key = waiting[0].request.options.batch_key
            batch = [j for j in waiting if j.request.options.batch_key == key and not j.request.stream_drafts]
            batch = [waiting[0]] if waiting[0].request.stream_drafts else self._fit(batch[: self.max_batch_size])
            taken = {id(j) for j in batch}
            self.queue = deque(j for j in waiting if id(j) not in taken)
            self.running += len(batch)
            return batch

    def _waiting(self) -> list[Job]:
        """The queue without the jobs cancelled while they waited (dropped and counted; the caller holds `cond`):
        a running call's join points drop them too, so they never count as waiting (`--max-waiting`, `/health`)
        while a call of their options keeps running."""
        waiting = [j for j in self.queue if not j.cancelled.is_set()]
        if len(waiting) < len(self.queue):
            self.counts["cancelled"] += len(self.queue) - len(waiting)
            self.queue = deque(waiting)
        return waiting

    def _fit(self, group: list[Job], rows: int = 0, width: int = 0) -> list[Job]:
        """The oldest requests of `group` that fit beside `rows` running rows whose widest prompt has `width` tokens:
        at most `max_batch_size` rows in all, and rows x widest prompt (a new batch's prefill, a joining prefill)
        within `max_step_tokens` (a request that starts a batch always fits: it was checked alone)."""
        batch = []
        for job in group:
            if rows + len(batch) >= self.max_batch_size:
                break
            wider = max(width, len(job.request.prompt_ids))
            if ((rows or batch) and self.max_step_tokens is not None
                    and (rows + len(batch) + 1) * wider > self.max_step_tokens):
                continue
            batch.append(job)
            width = wider
        return batch

    def _take_joining(self, key: str, rows: int, width: int) -> list[Job]:
        """Waiting jobs that join a running call of options `key` now, given its `rows` and its widest prompt:
        none while the oldest waiting job has other options (it runs next: no group is passed over) or does not fit
        beside the running rows (the call drains until it does: no younger job passes it over); else the oldest
        jobs of `key` that :meth:`_fit` beside the running rows."""
        with self.cond:
            if self.closed:
                return []
            waiting = self._waiting()
            if not waiting or waiting[0].request.options.batch_key != key or waiting[0].request.stream_drafts:
                return []
            taken = self._fit([j for j in waiting if j.request.options.batch_key == key
                               and not j.request.stream_drafts], rows, width)
            if not taken or taken[0] is not waiting[0]:     # the oldest does not fit yet: none passes it over
                return []
            ids = {id(j) for j in taken}
            self.queue = deque(j for j in self.queue if id(j) not in ids)
            self.running += len(taken)
            return taken

    def _release(self, rows: int) -> None:
        """`rows` requests are done (their rows are free)."""
        with self.cond:
            self.running -= rows
            self.cond.notify_all()

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
                    self.batch_seconds.append(time.perf_counter() - started)

    def _run(self, jobs: list[Job]) -> None:
        """Decode a batch; if the library refuses it (ValueError or NotImplementedError, before any forward), the
        oldest request alone, the others back at the head of the queue, where they join it at its first join point
        (each checked as a row of its own) or start the next batch: only a bad request gets the error (a budget
        that fits one prompt may not fit the batch's largest), and the good ones still decode together. The
        library's message is said in the server's terms (:func:`~.protocol.server_error`)."""
        try:
            self._decode(jobs)
        except (ValueError, NotImplementedError) as err:
            if len(jobs) > 1:
                with self.cond:
                    self.queue.extendleft(reversed(jobs[1:]))
                    self.running -= len(jobs) - 1
                    self.cond.notify_all()
                self._run(jobs[:1])
                return
            self._count("errors")
            jobs[0].emit("error", _refusal(err, jobs[0]))
            self._release(1)
        except Exception as err:                                  # noqa: BLE001 - reported to the client
            traceback.print_exc()
            for job in jobs:
                self._count("errors")
                job.emit("error", (500, f"{type(err).__name__}: {err}"))
            self._release(len(jobs))

    def _generate_kwargs(self, jobs: list[Job]) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
        """`(input_ids, attention_mask, keywords)` of the `generate` call that starts with `jobs`."""
        options = jobs[0].request.options
        ids, valid, _ = left_pad([torch.tensor(j.request.prompt_ids, dtype=torch.long) for j in jobs])
        kwargs = {**options.generate_kwargs(per_row=not jobs[0].request.stream_drafts), **self._sampling(options)}
        if get_strategy(options.decoding_strategy).uses_drafter and self.drafter is not None:
            kwargs["draft_model"] = self.drafter
        if options.do_sample:             # one generator per row: a request's draws do not depend on its batch
            kwargs["generator"] = [self._generator(j) for j in jobs]
        return ids.masked_fill(~valid, self.pad_token_id), valid.long(), kwargs

    def _sampling(self, options) -> dict[str, Any]:
        """A sampled request's temperature, top-k and top-p: its own, else the model's generation config's, else
        neutral (1.0, no top-k, 1.0; not transformers' fallback top-k of 50, which OpenAI-style requests do not
        know); none for a greedy request. One rule for a batch's call, its rows and a `stream_drafts` call."""
        if not options.do_sample:
            return {}
        gc = self.model.generation_config

        def pick(value, default, neutral):
            return value if value is not None else default if default is not None else neutral

        return {"temperature": pick(options.temperature, gc.temperature, 1.0),
                "top_k": pick(options.top_k, gc.top_k, 0), "top_p": pick(options.top_p, gc.top_p, 1.0)}

    def _warpers(self, options) -> dict[str, Any]:
        """A joining row's own warpers (:meth:`_sampling`), for a strategy with per-row sampling; none otherwise."""
        return self._sampling(options) if get_strategy(options.decoding_strategy).per_row_sampling else {}

    def _generator(self, job: Job) -> torch.Generator | None:
        options = job.request.options
        if not options.do_sample:
            return None
        seed = options.seed if options.seed is not None else random.getrandbits(63)
        return torch.Generator(self.device).manual_seed(seed)

    def _decode(self, jobs: list[Job]) -> None:
        if jobs[0].request.stream_drafts:
            return self._decode_streaming_drafts(jobs[0])
        ids, mask, kwargs = self._generate_kwargs(jobs)
        feed = _QueueFeed(self, jobs, kwargs.get("generator"))
        try:
            self.model.generate(ids.to(self.device), attention_mask=mask.to(self.device),
                                max_new_tokens=max(j.request.max_tokens for j in jobs), pad_token_id=self.pad_token_id,
                                row_feed=feed, **self.entry, **kwargs)
        except Exception:
            if not feed.started:          # refused before any row ran: `_run` answers (each job alone on a 400)
                raise
            traceback.print_exc()         # a failure once rows ran: every row not yet done gets a 500
            feed.fail_open_rows()
        self._count("batches")

    def _decode_streaming_drafts(self, job: Job) -> None:
        """A `stream_drafts` request, alone: the library's streamer protocol (drafts included), its budget and
        cancellation through a stopping criterion."""
        ids, mask, kwargs = self._generate_kwargs([job])
        width = ids.shape[1]
        streams = RowStreams([job], width, self.stop_ids)
        kwargs["streamer"] = streams.streamer(0)
        out = self.model.generate(ids.to(self.device), attention_mask=mask.to(self.device),
                                  max_new_tokens=job.request.max_tokens, pad_token_id=self.pad_token_id,
                                  return_dict_in_generate=True, stopping_criteria=StoppingCriteriaList([streams]),
                                  **self.entry, **kwargs)
        self._count("batches")
        stats = out.spec_stats_per_row[0]
        tokens = out.sequences[0, width:][: stats.num_generated_tokens].tolist()
        if streams.sent[0] < len(tokens):                  # not yet streamed (never expected): send the rest
            job.emit("tokens", tokens[streams.sent[0]:])
        stopped = tokens and tokens[-1] in self.stop_ids and not job.request.options.ignore_eos
        self._release(1)
        self._finish(job, tokens, "stop" if stopped else "length", stats, 1)

    def _finish(self, job: Job, tokens: list[int], reason: str, stats, batch_size: int) -> None:
        """A row's result: history, counters, the `done` event."""
        if job.cancelled.is_set():
            self._count("cancelled")
            reason = "cancelled"
        self.history.append({"id": job.id, "tokens": len(tokens), "finish_reason": reason,
                             "batch_size": batch_size, "time": time.time()})
        job.emit("done", Result(tokens, reason, row_stats(stats, job.request.options.decoding_strategy, batch_size)))


class _QueueFeed(RowFeed):
    """The rows of one `generate` call: the jobs it started with, then waiting jobs of the same options that join
    while it runs (see the module docstring for which and when)."""

    def __init__(self, batcher: Batcher, jobs: list[Job], generators: list | None) -> None:
        self.batcher, self.key = batcher, jobs[0].request.options.batch_key
        super().__init__([self._request(job, len(jobs), g)
                          for job, g in zip(jobs, generators or [None] * len(jobs))])
        self.width = max(len(j.request.prompt_ids) for j in jobs)
        self.open: dict[int, Job] = {id(j): j for j in jobs}             # rows not yet done
        self.started_with = len(jobs)
        self.joined = 0

    @property
    def started(self) -> bool:
        """Whether any row has joined or ended (the call is past its checks)."""
        return self.joined > 0 or len(self.open) < self.started_with

    def _request(self, job: Job, batch_size: int, generator) -> RowRequest:
        def done(tokens, reason, stats) -> None:
            self.open.pop(id(job), None)
            self.batcher._release(1)                  # before the client hears of it: its row is free
            self.batcher._finish(job, tokens, reason, stats, batch_size)

        def error(err: ValueError) -> None:
            self.open.pop(id(job), None)
            self.batcher._count("errors")
            self.batcher._release(1)
            job.emit("error", _refusal(err, job))

        options = job.request.options
        return RowRequest(list(job.request.prompt_ids), job.request.max_tokens, generator=generator,
                          ignore_eos=options.ignore_eos and options.per_row_stops,
                          **self.batcher._warpers(options), on_tokens=lambda ids: job.emit("tokens", ids),
                          on_done=done, on_error=error, cancelled=job.cancelled)

    def take(self, rows: int) -> list[RowRequest]:
        jobs = self.batcher._take_joining(self.key, rows, self.width)
        self.joined += len(jobs)
        self.width = max([self.width] + [len(j.request.prompt_ids) for j in jobs])
        requests = []
        for job in jobs:
            self.open[id(job)] = job
            requests.append(self._request(job, rows + len(jobs), self.batcher._generator(job)))
        return requests

    def fail_open_rows(self) -> None:
        """The call failed after rows joined: each row not yet done gets the error (500) here, once."""
        for job in list(self.open.values()):
            self.open.pop(id(job), None)
            self.batcher._count("errors")
            job.emit("error", (500, "the batch this request joined failed; retry the request"))
            self.batcher._release(1)
