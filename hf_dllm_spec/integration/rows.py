"""The rows of a running `generate` call: where each row's output ends and, with continuous batching, the rows that
join the call and leave it.

Where a row ends: the budget, the first stop id (kept, transformers' convention), the first position where one of
transformers' stopping criteria fires for the row; and `stop_strings` as a criterion. A block decoder finishes
several tokens at once and its rows advance at different paces; :class:`RowEnds` decides, from each row's final
tokens, whether the row ends and what it returns, calling the stopping criteria as stock `generate` calls them
(:class:`CriteriaScan`), only those that the budget and the stop ids do not already decide
(:func:`criteria_to_scan`).

Continuous batching: requests join a running `generate` call and leave it as soon as they end.

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
from typing import Any, Callable

import torch
from transformers import (EosTokenCriteria, LogitsProcessorList, MaxLengthCriteria, StoppingCriteriaList,
                          StopStringCriteria)

from ..maths.sampling import RowProcessors, row_processors
from ..outputs import SpecDecodingStats
from ..strategies.base import DecodingStrategy, JoiningRow, RowAdmission
from ..validation import invalid


def stop_strings_as_criteria(kwargs: dict[str, Any], model_config=None) -> dict[str, Any]:
    """Turn `stop_strings=` (+ `tokenizer=`) into a `StopStringCriteria` in `stopping_criteria`; without the
    keyword, the stop strings of a passed `generation_config`, which then goes on to transformers with None there.

    transformers drops `tokenizer` before calling a `custom_generate` callable and then cannot build the
    stop-string criterion itself (it raises that no tokenizer was given); built here, it reaches the decoding loop
    like any other criterion. Stop strings in the model's own generation config cannot be taken out of
    transformers' way (it fills every unset field of a passed config from the model's), so they are refused with
    the fix. (On a plain transformers model's `custom_generate=` path, `stop_strings` is a parameter of the
    callable, which reads the tokenizer from the `generate` call: :func:`dllm_generate`.)

    Args:
        kwargs (`dict`): the keywords of a `generate` call of the library's model classes.
        model_config (`GenerationConfig`, *optional*): the model's generation config.

    Raises:
        ValueError: stop strings given without `tokenizer`, or set in the model's generation config.
    """
    configured = getattr(model_config, "stop_strings", None)
    if configured is not None:
        raise invalid("generation_config.stop_strings", configured, "be None in the model's generation config: "
                      "transformers drops `tokenizer` before a custom decoding loop and then refuses them",
                      "set `model.generation_config.stop_strings = None` and pass stop_strings=... with "
                      "tokenizer=... to generate")
    config = kwargs.get("generation_config")
    stop_strings = kwargs.pop("stop_strings", None)
    if getattr(config, "stop_strings", None) is not None:
        stop_strings = config.stop_strings if stop_strings is None else stop_strings
        kwargs["generation_config"] = copy.deepcopy(config)
        kwargs["generation_config"].stop_strings = None
    if stop_strings is None:
        return kwargs
    tokenizer = kwargs.pop("tokenizer", None)
    if tokenizer is None:
        raise invalid("stop_strings", stop_strings, "come with `tokenizer`",
                      "pass tokenizer=<the model's tokenizer> to generate")
    criteria = StoppingCriteriaList(kwargs.pop("stopping_criteria", None) or [])
    criteria.append(StopStringCriteria(tokenizer, stop_strings))
    kwargs["stopping_criteria"] = criteria
    return kwargs


def stop_cut(ids: list[int], stop_ids: set[int]) -> int:
    """Length of `ids` up to and including the first stop id (kept, HF convention); all of them without one."""
    if stop_ids.isdisjoint(ids):                  # the common case, scanned in C
        return len(ids)
    return next(k + 1 for k, token in enumerate(ids) if token in stop_ids)


def row_end(ids: list[int], budget: int, stops: set[int], start: int = 0) -> tuple[int, bool]:
    """Where a row's final tokens `ids` end: `(cut, ended)`, the length it returns (at most `budget`, up to and
    including the first of `stops`) and whether it decodes no more (a stop id, the budget, or tokens past the cut).
    `start`: the first `start` ids are known to hold no stop id (checked before), so only the rest is scanned."""
    start = min(start, budget, len(ids))
    cut = start + stop_cut(ids[start:budget], stops)
    return cut, cut < len(ids) or cut >= budget or (cut > 0 and ids[cut - 1] in stops)


class StopScan:
    """:func:`row_end` for rows whose final tokens grow as one host list each (the decoding loop extends it in place
    as blocks finish): each check scans only the ids appended since the row's last check, so a row of n tokens costs
    O(n) over the whole call instead of O(n) per check (O(n^2)).

    A check that passes another list object for the row (a strategy that rebuilds the list, e.g. with provisional
    tokens) scans it whole, as :func:`row_end` does; a row's scan is forgotten once it ends.
    """

    def __init__(self) -> None:
        self._seen: dict[int, tuple[list[int], int]] = {}      # row key -> (its list, ids known free of stops)

    def row_end(self, key: int, ids: list[int], budget: int, stops: set[int]) -> tuple[int, bool]:
        """:func:`row_end` of `ids`, row `key` (e.g. the prompt index)."""
        seen = self._seen.get(key)
        cut, ended = row_end(ids, budget, stops, seen[1] if seen is not None and seen[0] is ids else 0)
        if ended:
            self._seen.pop(key, None)
        else:
            self._seen[key] = (ids, len(ids))
        return cut, ended


def criteria_to_scan(criteria, stop_ids: list[int], prompt_width: int, max_new_tokens: int) -> StoppingCriteriaList:
    """The stopping criteria the decoding loop must call: those of `criteria` that the budget and the stop ids do
    not already decide.

    transformers' `generate` always adds a `MaxLengthCriteria` (prompt width + `max_new_tokens`) and an
    `EosTokenCriteria` (the eos ids); a row already ends at its budget and after its first stop id, so these two
    fire exactly where the row ends anyway, and calling them for every position of every finished block (a few
    kernels and one host read each) changes nothing. A `MaxLengthCriteria` shorter than the budget, an
    `EosTokenCriteria` with ids outside `stop_ids`, subclasses of either and every other criterion are kept.

    Args:
        criteria (`StoppingCriteriaList` or `None`): as `generate` prepared them.
        stop_ids (`list[int]`): the ids a row stops after. prompt_width (`int`): P, the padded prompt width the
            criteria see first. max_new_tokens (`int`): the budget.

    Returns:
        `StoppingCriteriaList` (empty when none is left).
    """
    kept = StoppingCriteriaList()
    for criterion in criteria or []:
        if type(criterion) is MaxLengthCriteria and criterion.max_length - prompt_width >= max_new_tokens:
            continue
        if type(criterion) is EosTokenCriteria and set(
                torch.as_tensor(criterion.eos_token_id).reshape(-1).tolist()) <= set(stop_ids):
            continue
        kept.append(criterion)
    return kept


class CriteriaScan:
    """transformers' stopping criteria, called as transformers calls them: the whole batch in, one verdict per row.

    Stock `generate` calls its criteria once per generated position t on the batch `(N, P + t)` (the padded prompts,
    then every row's tokens, finished rows continued with `pad_token_id`) and a row ends at the first t where a
    criterion fires for it; criteria may keep per-row state across calls (lm-evaluation-harness's stop sequences do)
    or return one bool for the batch. A block decoder finishes several tokens at once and its rows advance at
    different paces, so position t is evaluated once every row's token t is final (or the row has ended), with
    `scores=None` (per-token scores are not defined for out-of-order commits): each row is then cut at the exact
    token where a criterion first fires for it, as in stock `generate`; a row that runs ahead of the batch may decode
    past its cut (the surplus is discarded).

    Raises:
        ValueError: from :meth:`observe`, when a criterion fails on `scores=None` (a TypeError or AttributeError
            inside it, chained).
    """

    def __init__(self, criteria, input_ids: torch.Tensor, pad_token_id: int | None, max_new_tokens: int) -> None:
        n = input_ids.shape[0]
        self.criteria, self.input_ids, self.max_new_tokens = criteria, input_ids, max_new_tokens
        self.pad = pad_token_id if pad_token_id is not None else 0
        self.tokens: list[torch.Tensor] = [input_ids.new_empty(0)] * n    # each row's final tokens so far
        self.ended = [False] * n                                           # no more tokens will come
        self.cut: list[int | None] = [None] * n
        self.checked = 0                                                   # positions evaluated

    def observe(self, prompt_index: int, tokens: torch.Tensor, *, ended: bool = False) -> int | None:
        """Record row `prompt_index`'s final tokens `(n,)` (cut to the budget and the first stop id; `ended` when
        no more will come), evaluate every position the whole batch now knows, and return the length at which
        the row ends, or None while no criterion has fired for it."""
        self.tokens[prompt_index] = tokens
        self.ended[prompt_index] = self.ended[prompt_index] or ended
        verdicts = []
        while self.checked < self.max_new_tokens and all(self._settled(n) for n in range(len(self.tokens))):
            self.checked += 1
            verdicts.append((self.checked, self._call(self.checked)))
            if len(self.tokens) > 1:           # a batch: a row cut at t is continued with padding after t: read now
                self._apply(verdicts)
                verdicts = []
        self._apply(verdicts)                  # batch 1: one host read for all positions (after its cut the row's
        return self.cut[prompt_index]          # verdicts no longer matter, so the criteria may see its tokens)

    def _settled(self, n: int) -> bool:
        """Whether row n's token at position `checked + 1` is known (or the row has ended before it)."""
        return self.ended[n] or self.cut[n] is not None or self.tokens[n].shape[0] > self.checked

    def _call(self, t: int) -> torch.Tensor:
        """Call the criteria on position t (every row's first t tokens, padded after its cut); `(N,)` bool."""
        rows = []
        for n, tokens in enumerate(self.tokens):
            length = tokens.shape[0] if self.cut[n] is None else self.cut[n]
            row = tokens[:min(t, length)].to(self.input_ids.device)
            rows.append(torch.cat([row, row.new_full((t - row.shape[0],), self.pad)]))
        try:
            fired = self.criteria(torch.cat([self.input_ids, torch.stack(rows)], dim=1), None)
        except (TypeError, AttributeError) as error:      # e.g. `scores.argmax()` on None
            raise invalid("stopping_criteria", ", ".join(type(c).__name__ for c in self.criteria),
                          "judge from `input_ids` alone: they are called with scores=None (per-token scores are not "
                          f"defined when a decoder commits tokens out of order), and one failed ({error})",
                          "make the criterion ignore its `scores` argument") from error
        return torch.as_tensor(fired, device=self.input_ids.device).expand(len(rows))

    def _apply(self, verdicts: list[tuple[int, torch.Tensor]]) -> None:
        """Cut each row at the first position whose verdict fires for it (the verdicts read on the host at once)."""
        if not verdicts:
            return
        fired = torch.stack([v for _, v in verdicts]).tolist()
        for (t, _), row_fired in zip(verdicts, fired):
            for n, tokens in enumerate(self.tokens):
                if self.cut[n] is None and tokens.shape[0] >= t and row_fired[n]:
                    self.cut[n] = t


class RowEnds:
    """Each row's end for one call: the budget, the first stop id, the first criterion that fires.

    Args:
        max_new_tokens (`int`): the budget. stop_ids (`Iterable[int]`): a row ends after the first of them.
        criteria (`StoppingCriteriaList`): the criteria left to call (:func:`criteria_to_scan`; may be empty).
        input_ids (`torch.Tensor` of shape `(N, P)`): the padded prompts the criteria see first.
        pad_id (`int` or None): what continues a row after its end, for the criteria.
    """

    def __init__(self, max_new_tokens: int, stop_ids, criteria, input_ids: torch.Tensor, pad_id: int | None) -> None:
        self.max_new_tokens, self.stop_set = max_new_tokens, set(stop_ids)
        self.scan = CriteriaScan(criteria, input_ids, pad_id, max_new_tokens) if criteria else None
        self.stops = StopScan()

    def final_tokens(self, prompt_index: int, generated: torch.Tensor, ended: bool = False,
                     host_ids: list[int] | None = None) -> tuple[torch.Tensor, bool]:
        """What row `prompt_index` returns of its tokens `generated` `(n,)` (`ended`: it decodes no more), and whether
        it ends there. One host read of the tokens, none when the caller passes them as `host_ids`."""
        ids = host_ids if host_ids is not None else generated[:self.max_new_tokens + 1].tolist()
        cut, ends_here = row_end(ids, self.max_new_tokens, self.stop_set)
        tokens = generated[:cut]
        ended = ended or ends_here
        if self.scan is not None:
            criteria_cut = self.scan.observe(prompt_index, tokens, ended=ended)
            if criteria_cut is not None:
                return tokens[:criteria_cut], True
        return tokens, ended

    def stop_check(self, prompt_index: int, generated: torch.Tensor, host_ids: list[int] | None) -> bool:
        """The session's `stop_check`: whether the row ends after `generated` (from `host_ids` alone, no tensor
        operation, when no stopping criterion is left to call)."""
        if self.scan is None and host_ids is not None:
            return self.stops.row_end(prompt_index, host_ids, self.max_new_tokens, self.stop_set)[1]
        return self.final_tokens(prompt_index, generated, host_ids=host_ids)[1]

    def output_tokens(self, prompt_index: int, generated: torch.Tensor, ended: bool = False) -> torch.Tensor:
        """What row `prompt_index` returns of its final tokens: :meth:`final_tokens` without the verdict.

        Args:
            prompt_index (`int`): the row.
            generated (`torch.Tensor` of shape `(n,)`, int64): the row's final tokens so far.
            ended (`bool`, defaults to False): the row decodes no more (passed on to the stopping criteria's
                scan).

        Returns:
            `torch.Tensor` of shape `(m,)`, `m <= n`: `generated` cut at the budget, after the first stop id and at
            the first position where a stopping criterion fires.
        """
        return self.final_tokens(prompt_index, generated, ended)[0]

    def finish(self, generated: list[torch.Tensor]) -> list[torch.Tensor]:
        """Every row's output once all rows have ended (the criteria then see every position)."""
        if self.scan is not None:
            for n, g in enumerate(generated):
                self.output_tokens(n, g, ended=True)
        return [self.output_tokens(n, g, ended=True) for n, g in enumerate(generated)]


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
        decoded tokens), as :meth:`~hf_dllm_spec.integration.rows.RowEnds.finish` does for a plain call."""
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


__all__ = ["CriteriaScan", "FeedAdmission", "RowEnds", "RowFeed", "RowRequest", "StopScan", "check_request",
           "criteria_to_scan", "row_end", "stop_cut", "stop_strings_as_criteria"]
