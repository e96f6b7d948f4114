"""Strategy interface: one class per `decoding_strategy`, built from a validated config and a session."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Callable, ClassVar

import torch
from transformers import LogitsProcessorList

from ..configuration import DecodingConfig
from ..outputs import BatchStats
from ..runtime.runner import ModelRunner
from ..maths.sampling import Sampler
from .streaming import TokenStream
from ..validation import invalid


@dataclass
class JoiningRow:
    """A request that joins a running batch (continuous batching).

    Attributes:
        prompt (`torch.Tensor` of shape `(P,)`, int64): its prompt, without padding.
        generator (`torch.Generator`, *optional*): its own generator (required when the batch samples).
        logits_processor (`LogitsProcessorList`, *optional*): its own processors (its sampling settings), when the
            sampler has per-row processors (:class:`~hf_dllm_spec.maths.sampling.RowProcessors`).
    """

    prompt: torch.Tensor
    generator: torch.Generator | None = None
    logits_processor: LogitsProcessorList | None = None


class RowAdmission(ABC):
    """Continuous batching, the strategies' side: which rows join the running batch at a join point, which rows are
    cancelled, and who hears of a row that leaves. :class:`~hf_dllm_spec.integration.rows.FeedAdmission`
    implements it over the server's queue."""

    @abstractmethod
    def take(self, rows: int) -> list[JoiningRow]:
        """The rows that join now, given the `rows` now in the batch (none, usually: it is asked at every join
        point). Must not block."""

    def cancelled(self, prompt_index: int) -> bool:
        """Whether row `prompt_index` is to leave the batch now, unfinished (its client went away)."""
        return False

    def left(self, prompt_index: int) -> None:
        """Row `prompt_index` has left the batch (finished or cancelled); its counters are final."""

    def budget(self, prompt_index: int) -> int | None:
        """Row `prompt_index`'s own budget in tokens (None: the call's `max_new_tokens`)."""
        return None


class RowStates:
    """One Python object per row of the batch (a strategy's own per-row state: S2D2's routing policies), which
    follows its row: pass :meth:`select_rows` and :meth:`add_rows` to :meth:`DecodingSession.follow`. It holds
    no reference to the strategy or the session, so following it makes no reference cycle (a cycle would keep a
    call's objects, tensors and device memory included, until Python's cyclic collector runs).

    Args:
        make (`Callable[[], object]`): a fresh state, for each row the batch starts with and each row that joins.
        rows (`int`): the rows the batch starts with.
    """

    def __init__(self, make: Callable[[], object], rows: int) -> None:
        self.make = make
        self.items = [make() for _ in range(rows)]

    def select_rows(self, index: torch.Tensor) -> None:
        """Keep rows `index` `(M,)` int64, in that order."""
        self.items = [self.items[i] for i in index.tolist()]

    def add_rows(self, count: int) -> None:
        """`count` rows joined the batch: a fresh state each."""
        self.items.extend(self.make() for _ in range(count))

    def __iter__(self):
        return iter(self.items)

    def __getitem__(self, row: int):
        return self.items[row]

    def __len__(self) -> int:
        return len(self.items)


@dataclass
class DecodingSession:
    """Everything a strategy needs for one `generate` call, resolved and validated before any forward.

    Attributes:
        prompts (`list[torch.Tensor]`): each row's prompt without padding, `(P_n,)` int64, on `target.device`.
        target (`ModelRunner`): the model whose output is decoded (the self-drafting model of S2D2). The loop's
            tensors (blocks, probabilities, counters, the sampler's draws) live on its execution device
            (`target.device`, see :func:`~hf_dllm_spec.runtime.weights.execution_device`).
        sampler (`Sampler`): logits -> distributions and tokens; holds the generator.
        stats (`BatchStats`): per-row counters, updated in place.
        mask_token_id (`int`): the target's mask token (0 as a placeholder input where none is needed: AR
            decoding of a right-shifted model never reads the placeholder's logits).
        stop_token_ids (`list[int]`): a row stops after the block in which one of them is committed.
        max_new_tokens (`int`): budget in tokens per row (whole blocks are decoded, the caller trims).
        drafter (`ModelRunner`, *optional*): a separate drafter model (SimSD, DEER), with its own cache, family
            patch, alignment, device and dtype: a strategy moves the token ids (and row indices) it feeds to
            `drafter.device` and the drafter's block logits back to `target.device`; neither cache ever moves.
        draft_mask_token_id (`int`, *optional*): the drafter's mask token (a mask id of one family can be a real
            token of another: never shared).
        stop_check (`callable`, *optional*): `(prompt index, generated (n,), generated on the host or None) ->
            bool`, whether the row ends after
            `generated`: the budget, a stop id, or the caller's stopping criteria (`generate` passes one that reads
            the tokens on the host once); without it, the budget and the stop ids decide.
        stream (`TokenStream`, *optional*): receives final tokens (batch size 1).
        draft_block_size (`int`, *optional*): the drafter's block size (the target's is `config.block_size`).
        admission (`RowAdmission`, *optional*): continuous batching: rows join the running batch at the
            strategy's join points (:meth:`add_rows`), cancelled rows leave (strategies that support it call
            :meth:`joining_rows` / :meth:`cancelled_rows`; the others ignore it).
    """

    prompts: list[torch.Tensor]
    target: ModelRunner
    sampler: Sampler
    stats: BatchStats
    mask_token_id: int
    stop_token_ids: list[int]
    max_new_tokens: int
    drafter: ModelRunner | None = None
    draft_mask_token_id: int | None = None
    draft_block_size: int | None = None
    stop_check: Callable[[int, torch.Tensor, list[int] | None], bool] | None = None
    stream: TokenStream | None = None
    admission: RowAdmission | None = None
    _followers: list[Callable[[torch.Tensor], None]] = field(default_factory=list, repr=False)
    _growers: list[Callable[[int], None]] = field(default_factory=list, repr=False)
    _joinable: bool = field(default=True, repr=False)

    @property
    def batch_size(self) -> int:
        """The prompts of the call so far (the rows it started with, then every row that joined)."""
        return len(self.prompts)

    def follow(self, select_rows: Callable[[torch.Tensor], None],
               add_rows: Callable[[int], None] | None = None) -> None:
        """Have `select_rows(index)` called on every :meth:`select_rows` and `add_rows(count)` on every
        :meth:`add_rows` (a strategy's own per-row state: routing policies, a drafter's seen lengths). Without
        `add_rows` no row can join the batch (:attr:`joins` is False)."""
        self._followers.append(select_rows)
        if add_rows is None:
            self._joinable = False
        else:
            self._growers.append(add_rows)

    @property
    def joins(self) -> bool:
        """Whether rows may join this batch: an admission was given and every follower can add rows."""
        return self.admission is not None and self._joinable

    def select_rows(self, index: torch.Tensor) -> None:
        """The one owner of the batch's rows: keep the rows `index` `(M,)` int64, in that order, in the target's and
        the drafter's runners (their caches), the sampler's per-row generators, the counters and every follower
        (finished rows stop costing compute); the admission hears of every row that leaves."""
        before = list(self.stats.active)
        self.target.select_rows(index)
        if self.drafter is not None:
            self.drafter.select_rows(index)
        self.sampler.select_rows(index)             # per-row generators follow their rows
        self.stats.select(index.tolist())
        for select_rows in self._followers:
            select_rows(index)
        if self.admission is not None:
            staying = set(self.stats.active)
            for prompt_index in before:
                if prompt_index not in staying:
                    self.admission.left(prompt_index)

    def budget_of(self, prompt_index: int) -> int:
        """Row `prompt_index`'s budget in tokens: its own in a continuous batch, else `max_new_tokens`."""
        own = self.admission.budget(prompt_index) if self.admission is not None else None
        return own if own is not None else self.max_new_tokens

    def joining_rows(self) -> list[JoiningRow]:
        """The rows the admission lets join now (none without one, or when a follower cannot add rows)."""
        return self.admission.take(len(self.stats.active)) if self.joins else []

    def cancelled_rows(self) -> list[int]:
        """Batch indices of the rows the admission cancels now."""
        if self.admission is None:
            return []
        return [i for i, prompt_index in enumerate(self.stats.active) if self.admission.cancelled(prompt_index)]

    def add_rows(self, rows: list[JoiningRow]) -> list[int]:
        """Append `rows` to the batch, empty: the runners (no stored token yet), the sampler (their generators),
        the counters and every follower; return their prompt indices (the strategy then stores their prompts and
        starts their first blocks).

        Raises:
            ValueError: a sampling batch and a row without its own generator.
        """
        self.sampler.add_rows([row.generator for row in rows], [row.logits_processor for row in rows])
        self.prompts.extend(row.prompt.to(self.target.device) for row in rows)
        self.target.add_rows(len(rows))
        if self.drafter is not None:
            self.drafter.add_rows(len(rows))
        indices = self.stats.add_rows(len(rows))
        for add_rows in self._growers:
            add_rows(len(rows))
        return indices

    def draft_sampler(self) -> Sampler:
        """The separate drafter's sampler: the target's processors, mode and generator, the drafter's mask
        token suppressed."""
        s = self.sampler
        return Sampler(s.logits_processor, do_sample=s.do_sample, suppress_token_ids=[self.draft_mask_token_id],
                       generator=s.generator, device=s.device)

    def resolve_acceptance(self, acceptance: str | None) -> str:
        """The acceptance rule of a strategy with a separate drafter: `acceptance`, or by default "greedy_match"
        without sampling and "rejection_sampling" with it.

        Raises:
            ValueError: "greedy_match" with `do_sample=True` (sampled drafts verified by argmax would not follow the
                target's distribution).
        """
        if acceptance == "greedy_match" and self.sampler.do_sample:
            raise invalid("acceptance", "greedy_match", "not be combined with do_sample=True (sampled drafts are "
                          "verified with rejection sampling; greedy match would not follow the target's "
                          "distribution)", "drop `acceptance`, or pass do_sample=False")
        return acceptance or ("rejection_sampling" if self.sampler.do_sample else "greedy_match")


#: What a strategy's target may be (`DecodingStrategy.target_kind`).
TARGET_KINDS = ("any", "autoregressive", "diffusion")
#: What its drafter may be (`DecodingStrategy.drafter_kind`).
DRAFTER_KINDS = ("any", "diffusion", "same_family")


class DecodingStrategy(ABC):
    """Base class. Subclasses set the metadata and implement :meth:`decode`.

    Attributes:
        name (`str`): the `decoding_strategy` value.
        config_class (`type[DecodingConfig]`): its config, defined beside the strategy.
        paper (`str`): source of the algorithm.
        lossless (`bool`): whether outputs follow the target distribution exactly.
        requires_mask_token (`bool`): whether the target needs a mask token.
        uses_drafter (`bool`): whether the strategy runs a separate `draft_model` (then required).
        requires_draft_mask_token (`bool`): whether that drafter needs a mask token (a diffusion drafter).
        target_kind (`str`): the target it decodes, one of :data:`TARGET_KINDS`, checked by the plan before any
            forward: "any" (default), "autoregressive" (a right-shifted causal LM that is no diffusion LM: DEER's
            verifier) or "diffusion" (a diffusion LM).
        drafter_kind (`str`): the drafter, one of :data:`DRAFTER_KINDS`, checked likewise: "any" (default),
            "diffusion", or "same_family" (a diffusion LM of the target's family and alignment: SimSD's).
        decodes_whole_blocks (`bool`): whether every block on the grid is denoised whole, also past the budget
            (then a block larger than the whole sequence is refused,
            :func:`~hf_dllm_spec.integration.plan.check_block_budget`).
        per_row_stops (`bool`): whether the loop reads the stop ids only through :meth:`should_stop`, so that rows
            of one call may end by different stop rules (continuous batching: `ignore_eos` per request). False by
            default (a strategy whose tokens depend on the stop ids, such as SimSD's EOS gate).
        per_row_sampling (`bool`): whether every `Sampler.probs` / `scores` call of the loop names the batch rows
            of its logits when they are not all of them, so that rows may sample with their own warpers
            (continuous batching: temperature, top-k, top-p per request). False by default.
    """

    name: ClassVar[str]
    config_class: ClassVar[type[DecodingConfig]]
    paper: ClassVar[str] = ""
    lossless: ClassVar[bool] = False
    requires_mask_token: ClassVar[bool] = True
    uses_drafter: ClassVar[bool] = False
    requires_draft_mask_token: ClassVar[bool] = False
    target_kind: ClassVar[str] = "any"
    drafter_kind: ClassVar[str] = "any"
    decodes_whole_blocks: ClassVar[bool] = True
    per_row_stops: ClassVar[bool] = False
    per_row_sampling: ClassVar[bool] = False

    def __init__(self, config: DecodingConfig, session: DecodingSession) -> None:
        self.config, self.session = config, session

    @classmethod
    def check_block_sizes(cls, block_size: int, draft_block_size: int | None) -> None:
        """Raise `ValueError` if the drafter's block size does not fit the target's (default: must be equal)."""
        if draft_block_size is not None and draft_block_size != block_size:
            raise ValueError(
                f"`draft_block_size` (={draft_block_size}) must equal `block_size` (={block_size}) for "
                f"decoding_strategy={cls.name!r}; pass the same block size for both models."
            )

    def graph_inputs(self) -> list[tuple[object, str]]:
        """The tensors this strategy's steps read through attributes besides their arguments, as `(object,
        attribute name)`: its samplers' (:attr:`~hf_dllm_spec.maths.sampling.Sampler.graph_inputs`, the call's and
        a drafter's). A captured step takes their current tensors as inputs, copied into its graph's buffers before
        each replay (`StaticModelRunner.run_step`)."""
        samplers = [self.session.sampler, getattr(self, "draft_sampler", None)]
        found = {(id(obj), name): (obj, name) for sampler in samplers if sampler is not None
                 for obj, name in sampler.graph_inputs}
        return list(found.values())

    @abstractmethod
    def decode(self) -> list[torch.Tensor]:
        """Run the decoding loop; return each prompt's committed tokens, `(n_i,)` int64 (untrimmed)."""

    def stream_draft(self, final: torch.Tensor, provisional: torch.Tensor) -> None:
        """Batch 1 with a streamer: show `provisional` `(k,)`, the tokens that follow the row's `final` tokens
        `(n,)` and that a later step may still change, to a streamer with `put_draft` (transformers'
        `TextDiffusionStreamer` protocol); cut to the budget, nothing once the row's output is complete (a stop
        id, the budget or a stopping criterion, e.g. a stop string, ends it: :meth:`should_stop`). No-op without
        one."""
        s = self.session
        if s.stream is None or not s.stream.takes_drafts:
            return
        room = s.max_new_tokens - final.shape[0]
        if room <= 0 or self.should_stop(0, final):
            return
        s.stream.draft(provisional[:room])

    def should_stop(self, prompt_index: int, generated: torch.Tensor, host_ids: list[int] | None = None) -> bool:
        """Stop after a stop id, at the token budget, or when the caller's criteria say so (they are told of every
        row's final tokens, also of a row that a stop id or the budget ends: they judge the whole batch).
        `host_ids`: `generated` already read on the host, when the caller has it (no further device read)."""
        s = self.session
        if s.stop_check is not None:
            return s.stop_check(prompt_index, generated, host_ids)
        ids = host_ids if host_ids is not None else generated.tolist()
        return generated.shape[0] >= s.max_new_tokens or not set(ids).isdisjoint(s.stop_token_ids)
