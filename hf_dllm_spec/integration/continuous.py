"""Continuous batching: requests join a running `generate` call and leave it as soon as they end.

A server (or any caller) passes ``row_feed=`` to `generate`: a :class:`RowFeed` that holds the call's rows as
:class:`RowRequest` objects (one per row of `input_ids`, in order) and hands out waiting requests when asked. At
every join point of the strategy (between two denoising steps for the block strategies, between two draft-and-verify
cycles for SimSD and DEER) the running batch asks the feed for new rows; each joins with its own prompt, budget and
generator, is checked before any of its forwards, and is then decoded as if alone (its tokens are those of its own
batch-1 `generate` call: the library's batch == one-by-one property). Each row ends at its own budget, after its
first stop id, or when it is cancelled, and leaves the batch at once: its final tokens are streamed as they become
final (`on_tokens`) and its result given when it leaves (`on_done`).

Source: continuous batching (Orca, OSDI 2022; vLLM, SOSP 2023), at the granularity block diffusion allows; issue 37.
"""

from __future__ import annotations

import copy
import threading
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Callable

import torch
from transformers import LogitsProcessorList

from ..maths.sampling import RowProcessors, row_processors
from ..outputs import SpecDecodingStats
from ..strategies.base import DecodingStrategy, JoiningRow, RowAdmission
from ..validation import invalid
from .stopping import StopScan


@dataclass
class RowRequest:
    """One request of a continuous batch.

    Attributes:
        prompt_ids (`list[int]`): the prompt, without padding (at least one token).
        max_new_tokens (`int`): its own budget (>= 1).
        generator (`torch.Generator`, *optional*): its own generator (required when the call samples).
        ignore_eos (`bool`, defaults to False): decode to the budget whatever stop id comes (a strategy with
            `per_row_stops`; with the others pass `eos_token_id=None` to the call instead).
        temperature, top_k, top_p (*optional*): its own sampling warpers in a sampling call (None: the call's);
            the row gets the tokens of a batch-1 call with these settings (`maths.sampling.row_processors`).
        on_tokens (`callable`, *optional*): `(ids: list[int]) -> None`, called with each new run of final tokens.
        on_done (`callable`, *optional*): `(tokens: list[int], finish_reason: str, stats: SpecDecodingStats) -> None`
            when the row leaves the batch; `finish_reason` is "stop" (a stop id, kept), "length" (the budget) or
            "cancelled".
        on_error (`callable`, *optional*): `(error: ValueError) -> None` when a joining request is refused by the
            checks (it never runs a forward); without it the error is raised.
        cancelled (`threading.Event`): set it to have the row leave at the next join point.
    """

    prompt_ids: list[int]
    max_new_tokens: int
    generator: torch.Generator | None = None
    ignore_eos: bool = False
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    on_tokens: Callable[[list[int]], None] | None = None
    on_done: Callable[[list[int], str, SpecDecodingStats], None] | None = None
    on_error: Callable[[ValueError], None] | None = None
    cancelled: threading.Event = field(default_factory=threading.Event)


class RowFeed(ABC):
    """Where the requests of a continuous batch come from.

    Args:
        initial (`list[RowRequest]`): the requests of the call's `input_ids` rows, in order.
    """

    def __init__(self, initial: list[RowRequest]) -> None:
        self.initial = list(initial)

    @abstractmethod
    def take(self, rows: int) -> list[RowRequest]:
        """Requests that join now, given the `rows` now decoding (asked at every join point; must not block).
        The feed decides how many (its capacity) and which (its fairness)."""


class FeedAdmission(RowAdmission):
    """The session's admission over a :class:`RowFeed`: joining rows (checked), cancellations, each row's end and
    result.

    Args:
        feed (`RowFeed`): the requests.
        stop_ids (`Iterable[int]`): a row ends after the first of them (empty: `ignore_eos`).
        check (`callable`): `(prompt_ids: torch.Tensor (P,), max_new_tokens) -> None`, the call's checks of one row
            (token ids, positions, block budget; raises `ValueError`).
        stats (`callable`): `prompt_index -> SpecDecodingStats`, the row's counters.
        strategy (`type[DecodingStrategy]`): the call's strategy (its `per_row_stops` and `per_row_sampling` say
            whether a row may have its own `ignore_eos` and its own warpers).
    """

    def __init__(self, feed: RowFeed, stop_ids, check: Callable[[torch.Tensor, int], None],
                 stats: Callable[[int], SpecDecodingStats], strategy: type[DecodingStrategy],
                 do_sample: bool = True) -> None:
        self.feed, self.stop_set, self.check, self.stats, self.strategy = feed, set(stop_ids), check, stats, strategy
        self.do_sample = do_sample
        self.processors: RowProcessors | None = None             # per-row warpers, in a sampling call
        self.requests: list[RowRequest] = list(feed.initial)          # by prompt index
        self.sent = [0] * len(self.requests)                          # final tokens streamed per row
        self.tokens: list[list[int]] = [[] for _ in self.requests]    # final tokens per row (host)
        self.ended = [False] * len(self.requests)
        self.reported = [False] * len(self.requests)
        self.since = [time.perf_counter()] * len(self.requests)      # when each row started or joined (s)
        self.stops = StopScan()

    # -- the strategy's side ------------------------------------------------------------------------------------
    def take(self, rows: int) -> list[JoiningRow]:
        """The requests the feed hands out now, checked and registered as new rows (prompt indices after the
        current ones, in order).

        A request that fails :meth:`check_request` (or whose own warpers cannot be built) goes to its `on_error`
        and does not join; without `on_error` the error is raised.

        Args:
            rows (`int`): the rows now decoding (passed to :meth:`RowFeed.take`).

        Returns:
            `list[JoiningRow]`: one per accepted request: its prompt `(P,)` int64 on the CPU, its generator and,
            in a sampling call with per-row sampling, its own logits processors.

        Raises:
            ValueError: a refused request without `on_error`.
        """
        joining = []
        for request in self.feed.take(rows):
            try:
                self.check_request(request)
                processors = self.processors_of(request) if self.processors is not None else None
            except ValueError as err:
                if request.on_error is None:
                    raise
                request.on_error(err)
                continue
            self.requests.append(request)
            for values, empty in ((self.sent, 0), (self.tokens, []), (self.ended, False), (self.reported, False),
                                  (self.since, time.perf_counter())):
                values.append(empty)
            joining.append(JoiningRow(torch.tensor(request.prompt_ids, dtype=torch.long), request.generator,
                                      processors))
        return joining

    def attach(self, session) -> None:
        """Make `session` (a :class:`~hf_dllm_spec.strategies.base.DecodingSession`) continuous: this admission,
        each row's own stop rule and, in a sampling call, each row's own warpers."""
        session.admission, session.stop_check = self, self.stop_check
        if session.sampler.do_sample and self.strategy.per_row_sampling:
            self._call_processors, self._lists = session.sampler.logits_processor, {}
            self.processors = RowProcessors([self.processors_of(r) for r in self.requests], session.sampler.device)
            session.sampler.logits_processor = self.processors

    def processors_of(self, request: RowRequest) -> LogitsProcessorList:
        """The processors of `request`'s row (one object per distinct setting, shared by its rows)."""
        key = (request.temperature, request.top_k, request.top_p)
        if key not in self._lists:
            self._lists[key] = row_processors(self._call_processors, temperature=request.temperature,
                                              top_k=request.top_k, top_p=request.top_p)
        return self._lists[key]

    def cancelled(self, prompt_index: int) -> bool:
        """Whether row `prompt_index` leaves now, unfinished: its request's `cancelled` event is set and the row has
        not already ended (budget or stop id)."""
        return not self.ended[prompt_index] and self.requests[prompt_index].cancelled.is_set()

    def left(self, prompt_index: int) -> None:
        """Row `prompt_index` has left the batch: give its result now (:meth:`report`, once)."""
        self.report(prompt_index)

    def budget(self, prompt_index: int) -> int:
        """Row `prompt_index`'s own budget: its request's `max_new_tokens`, in tokens."""
        return self.requests[prompt_index].max_new_tokens

    # -- each row's end -----------------------------------------------------------------------------------------
    def check_request(self, request: RowRequest) -> None:
        """Raise `ValueError` for a request that cannot join (before any of its forwards): :func:`check_request`."""
        check_request(request, self.strategy, self.do_sample, self.check)

    def stop_check(self, prompt_index: int, generated: torch.Tensor, host_ids: list[int] | None) -> bool:
        """The session's `stop_check`: whether row `prompt_index` ends after its final tokens `generated` `(n,)`
        (its budget, a stop id); streams the tokens that became final."""
        ids = host_ids if host_ids is not None else generated.tolist()
        cut, ended = self.stops.row_end(prompt_index, ids, self.requests[prompt_index].max_new_tokens,
                                        self.stops_of(prompt_index))
        self.tokens[prompt_index] = ids[:cut]
        self.ended[prompt_index] = ended
        self.stream(prompt_index)
        return ended

    def stops_of(self, prompt_index: int) -> set[int]:
        """The stop ids of row `prompt_index` (none with `ignore_eos`)."""
        return set() if self.requests[prompt_index].ignore_eos else self.stop_set

    def stream(self, prompt_index: int) -> None:
        """Pass row `prompt_index`'s final tokens not yet streamed to its `on_tokens` (none once the request is
        cancelled); they count as sent either way."""
        request, tokens = self.requests[prompt_index], self.tokens[prompt_index]
        new = tokens[self.sent[prompt_index]:]
        if new and request.on_tokens is not None and not request.cancelled.is_set():
            request.on_tokens(new)
        self.sent[prompt_index] = len(tokens)

    def report(self, prompt_index: int) -> None:
        """Give row `prompt_index`'s result once (when it leaves the batch, or when the call ends); its statistics'
        `wall_time_s` is the row's own time in the batch, from the call's start or its joining to now."""
        if self.reported[prompt_index]:
            return
        self.reported[prompt_index] = True
        request, tokens = self.requests[prompt_index], self.tokens[prompt_index]
        if not self.ended[prompt_index]:
            reason = "cancelled"
        else:
            reason = "stop" if tokens and tokens[-1] in self.stops_of(prompt_index) else "length"
        stats = self.stats(prompt_index)
        stats.record_output(len(tokens))
        stats.wall_time_s = time.perf_counter() - self.since[prompt_index]
        if request.on_done is not None:            # a copy: the call's own statistics go on changing
            request.on_done(list(tokens), reason, copy.copy(stats))

    def finish(self, generated: list[torch.Tensor]) -> list[torch.Tensor]:
        """The call ended: report every row not yet reported; return the final tokens of the call's own rows, each
        ended by its request's budget and stop rule (`(n_i,)` int64 on the device of `generated[i]`, the row's
        decoded tokens), as :meth:`~hf_dllm_spec.integration.stopping.RowEnds.finish` does for a plain call."""
        for prompt_index in range(len(self.requests)):
            self.report(prompt_index)
        return [torch.tensor(self.tokens[n], dtype=torch.long, device=g.device) for n, g in enumerate(generated)]


def check_request(request: RowRequest, strategy: type[DecodingStrategy], do_sample: bool,
                  check: Callable[[torch.Tensor, int], None]) -> None:
    """The checks of one request of a continuous batch, before any of its forwards: its budget, its prompt, its own
    `ignore_eos` and warpers against the call's `strategy` and `do_sample`, then `check` (the call's checks of one
    row: :func:`~hf_dllm_spec.integration.plan.check_row` of its plan).

    Raises:
        ValueError: the first bad field, with the rule and the fix.
    """
    ids, budget = request.prompt_ids, request.max_new_tokens
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
        raise invalid("max_new_tokens", budget, "be an integer >= 1", "pass a positive budget")
    if not isinstance(ids, (list, tuple)):
        raise invalid("prompt_ids", f"<{type(ids).__name__}>", "be a list of int token ids",
                      "pass a list (e.g. `ids.tolist()` of a tensor)")
    if not ids:
        raise invalid("prompt_ids", "[]", "hold at least one token", "send a non-empty prompt")
    if do_sample and not isinstance(request.generator, torch.Generator):
        raise invalid("generator", type(request.generator).__name__, "be a torch.Generator for every request of "
                      "a sampling call (each row draws from its own)", "pass RowRequest(..., generator="
                      "torch.Generator(device).manual_seed(seed))")
    if request.ignore_eos and not strategy.per_row_stops:
        raise invalid("ignore_eos", True, f"be set per request only for strategies with per-row stop rules "
                      f"({strategy.name!r} reads the stop ids while it decodes)", "pass eos_token_id=None to "
                      "the call instead, for every row")
    own = {k: v for k, v in (("temperature", request.temperature), ("top_k", request.top_k),
                             ("top_p", request.top_p)) if v is not None}
    name = next(iter(own), None)
    if name is not None and not do_sample:
        raise invalid(name, own[name], "be set only in a sampling call (do_sample=True)", f"drop `{name}` from the "
                      "request, or decode the call with do_sample=True")
    if name is not None and not strategy.per_row_sampling:
        raise invalid(name, own[name], f"be set per request only for strategies with per-row sampling "
                      f"({strategy.name!r} does not name the rows of its draws)", "give the call the setting "
                      "instead, for every row")
    bad = next((t for t in ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < 2 ** 62), None)
    if bad is not None:
        raise invalid("prompt_ids", bad, "be token ids (non-negative integers)", "send ids of the model's "
                      "vocabulary")
    check(torch.tensor(ids, dtype=torch.long), budget)


__all__ = ["FeedAdmission", "RowFeed", "RowRequest", "check_request"]
