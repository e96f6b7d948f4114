"""From logits to per-position distributions, tokens and confidences.

Temperature, top-k, top-p and token suppression are transformers' own `LogitsProcessor` objects, applied
per position: a block's logits `(L, V)` are treated as a batch of `L` independent rows. The same processed
distribution is used for drafting and for verification (speculative sampling, Leviathan et al. 2023 / Chen et
al. 2023: both sides must carry the same transforms for rejection sampling to be lossless).

Only position-independent processors are accepted. Context-dependent ones (repetition penalty, n-gram
blocking, minimum length, forced tokens, grammars) need a left context per position, which is ill-defined
when tokens are committed out of order; they raise `NotImplementedError` instead of being ignored.

Randomness (`generate(..., generator=...)`): every random draw of a decoding goes through this module
(:meth:`Sampler.choose`, :func:`draw_categorical`, :func:`draw_uniforms`; :func:`draw_exponential` draws a
token draw's noise beforehand, for a compiled step), from one of two sources:

- one `torch.Generator` (or `None`: torch's global RNG) shared by the batch: each draw is one call over the whole
  batch, rows in order (the stream of earlier versions, unchanged);
- a list of `torch.Generator`, one per row (:class:`RowGenerators`): every draw of row i comes from generator i,
  and a row draws only what it would draw decoded alone, in the same order, so a sampled batch gives each row the
  tokens of its single-prompt decode with that generator (`generator=[g]`). Per row and per decoding step the
  order is: the token draw of each denoising step (one multinomial over the row's block positions, `(B, V)`;
  DEER: over the row's own drafts; SimSD: every drafter step while the row still has masks), then the
  verification of the row if it verifies (its `num_drafts` uniforms, then one residual draw on a rejection, or
  one bonus draw after full acceptance; :func:`~hf_dllm_spec.maths.verification.rejection_sample`), then SimSD's stop-
  id gate replacement when it fires; a right-shifted model with separate cache writes draws a new block's first
  token from the carry before the block's first step. Rows that leave the batch take their generator along.
  At batch size 1 a list `[g]` draws what `generator=g` draws, except SimSD's uniforms (a shared generator draws
  one per block position, a row's own generator one per draft).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import LogitsProcessorList
from transformers.generation.logits_process import (
    EpsilonLogitsWarper,
    EtaLogitsWarper,
    InfNanRemoveLogitsProcessor,
    LogitNormalization,
    MinLengthLogitsProcessor,
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    NoBadWordsLogitsProcessor,
    SequenceBiasLogitsProcessor,
    SuppressTokensLogitsProcessor,
    TemperatureLogitsWarper,
    TopHLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TypicalLogitsWarper,
)

from ..tracing import device_constant, recording_step
from ..validation import invalid

#: Processors whose output at a position depends on that position's logits alone.
POSITION_INDEPENDENT_PROCESSORS: tuple[type, ...] = (
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    MinPLogitsWarper,
    TypicalLogitsWarper,
    EpsilonLogitsWarper,
    SuppressTokensLogitsProcessor,
)

#: Position-independent too (`renormalize_logits`, `remove_invalid_values`, `top_h`, `eta_cutoff`), applied by the
#: eager step only: a compiled step keys and traces the classes above (`eta_cutoff`'s warper validates its
#: distribution on the host, which a CUDA graph cannot capture).
EAGER_POSITION_INDEPENDENT_PROCESSORS: tuple[type, ...] = (
    LogitNormalization,
    InfNanRemoveLogitsProcessor,
    TopHLogitsWarper,
    EtaLogitsWarper,
)
_ACCEPTED_PROCESSORS = POSITION_INDEPENDENT_PROCESSORS + EAGER_POSITION_INDEPENDENT_PROCESSORS


#: The `generate` option that makes transformers add each context-dependent processor (for the error message).
_PROCESSOR_OPTIONS = {
    "RepetitionPenaltyLogitsProcessor": "repetition_penalty",
    "EncoderRepetitionPenaltyLogitsProcessor": "encoder_repetition_penalty",
    "NoRepeatNGramLogitsProcessor": "no_repeat_ngram_size",
    "EncoderNoRepeatNGramLogitsProcessor": "encoder_no_repeat_ngram_size",
    "NoBadWordsLogitsProcessor": "bad_words_ids",
    "SequenceBiasLogitsProcessor": "sequence_bias",
    "MinLengthLogitsProcessor": "min_length",
    "MinNewTokensLengthLogitsProcessor": "min_new_tokens",
    "ForcedBOSTokenLogitsProcessor": "forced_bos_token_id",
    "ForcedEOSTokenLogitsProcessor": "forced_eos_token_id",
    "ExponentialDecayLengthPenalty": "exponential_decay_length_penalty",
    "SuppressTokensAtBeginLogitsProcessor": "begin_suppress_tokens",
    "PrefixConstrainedLogitsProcessor": "prefix_allowed_tokens_fn",
    "InfNanRemoveLogitsProcessor": "remove_invalid_values",
    "UnbatchedClassifierFreeGuidanceLogitsProcessor": "guidance_scale",
    "ClassifierFreeGuidanceLogitsProcessor": "guidance_scale",
    "WatermarkLogitsProcessor": "watermarking_config",
}


def _position_independent(proc) -> bool:
    """Exact class match (a user subclass may read `input_ids`, which the sampler cannot supply per position);
    a sequence bias (or bad words) on single tokens only is a fixed per-token bias."""
    if type(proc) in _ACCEPTED_PROCESSORS:
        return True
    if type(proc) in (SequenceBiasLogitsProcessor, NoBadWordsLogitsProcessor):
        return all(len(sequence) == 1 for sequence in proc.sequence_bias)
    return False


def active_processors(processors: LogitsProcessorList | None, prompt_width: int) -> LogitsProcessorList:
    """`processors` without transformers' length processors that act on no position of a call whose (padded)
    prompts are `prompt_width` tokens wide: a `MinLengthLogitsProcessor` with `min_length <= prompt_width` (it masks
    the stop ids only while the sequence is shorter; `generate` adds one for `min_length=1`, or for `min_new_tokens=0`
    as `min_length = 0 + prompt_width`), or a `MinNewTokensLengthLogitsProcessor` of 0 tokens. Stock `generate`
    leaves such a call's tokens as they are; so does this.

    Args:
        processors (`LogitsProcessorList`, *optional*): what `generate` prepared.
        prompt_width (`int`): P, the width of the call's `input_ids` `(N, P)`.

    Returns:
        `LogitsProcessorList`: the others, in order (a new list; empty for None).
    """
    def inert(proc) -> bool:
        if type(proc) is MinLengthLogitsProcessor:
            return proc.min_length <= prompt_width
        return type(proc) is MinNewTokensLengthLogitsProcessor and proc.min_new_tokens <= 0

    return LogitsProcessorList([proc for proc in processors or [] if not inert(proc)])


def check_logits_processors(processors: LogitsProcessorList | None) -> None:
    """Raise `NotImplementedError` unless every processor depends on each position's logits alone.

    Accepted by exact class: the processors of :data:`POSITION_INDEPENDENT_PROCESSORS` and
    :data:`EAGER_POSITION_INDEPENDENT_PROCESSORS`, and a `SequenceBiasLogitsProcessor` or
    `NoBadWordsLogitsProcessor` whose sequences are single tokens (what transformers' token healing builds).

    Raises:
        NotImplementedError: naming the `generate` option that added the processor (e.g. `repetition_penalty`),
            or `logits_processor` for a processor passed by the user, and listing the supported ones.
    """
    refused = [proc for proc in processors or [] if not _position_independent(proc)]
    if refused:
        # transformers derives `min_length` from `min_new_tokens` (both processors): name the option the user set
        proc = next((p for p in refused if type(p) is MinNewTokensLengthLogitsProcessor), refused[0])
        name = type(proc).__name__
        option = _PROCESSOR_OPTIONS.get(name, "logits_processor") if type(proc).__module__.startswith(
            "transformers.") else "logits_processor"
        supported = ", ".join(c.__name__ for c in _ACCEPTED_PROCESSORS)
        raise invalid(option, f"<{name}>", "add only processors that depend on each position's logits alone "
                      "(the context of a position is ill-defined when a diffusion decoder commits tokens out of "
                      f"order; subclasses are refused because they may read `input_ids`). Supported: {supported}",
                      f"drop `{option}`" if option == "logits_processor" else
                      f"pass {option}=None to generate, or set `generation_config.{option} = None` (the model's own "
                      "generation_config.json may set it)", error=NotImplementedError)


class RowGenerators:
    """One `torch.Generator` per batch row: per-row randomness (see the module docstring for the order).

    Shared by every sampler of a decoding (target and drafter); :meth:`select` follows the rows that stay in the
    batch, so each row keeps its own generator when finished rows leave.

    Args:
        generators (`Sequence[torch.Generator]`): row i's generator at index i (checked by
            :func:`~hf_dllm_spec.integration.plan.check_generator` before any forward).
    """

    def __init__(self, generators: Sequence[torch.Generator]) -> None:
        self.generators = list(generators)

    def __len__(self) -> int:
        return len(self.generators)

    def __getitem__(self, row: int) -> torch.Generator:
        return self.generators[row]

    def select(self, index: torch.Tensor | Sequence[int]) -> None:
        """Keep the rows `index` `(M,)`, in that order (in place: every sampler sharing this object follows)."""
        self.generators = [self.generators[i] for i in _as_list(index)]

    def extend(self, generators: Sequence[torch.Generator]) -> None:
        """Append the generators of rows that join the batch (continuous batching), in place."""
        self.generators.extend(generators)

    def subset(self, index: torch.Tensor | Sequence[int]) -> "RowGenerators":
        """A new object over the rows `index` `(M,)` (the same generator objects: drawing advances them)."""
        return RowGenerators([self.generators[i] for i in _as_list(index)])


class RowProcessors:
    """One `LogitsProcessorList` per batch row: per-row sampling settings (temperature, top-k, top-p of each request
    of a continuous batch). Rows whose lists are the same object are processed together; each list is applied to
    its rows' positions exactly as a batch-1 call applies it, so a row gets the scores of its own call.

    Inside a compiled or captured step (:func:`~hf_dllm_spec.tracing.recording_step`) the rows are named by a tensor
    instead of Python lists, so the step's graph does not depend on which row has which settings: every distinct
    list seen so far (:attr:`groups`, in order of first use) is applied to all rows and each row keeps its own
    list's scores (`torch.where` over :attr:`group_ids`, kept in step with the rows on the host); the step
    specialises on the groups (:func:`processors_key`), not on the rows. The scores are those of the eager path
    (each position is processed alone either way). A captured step takes :attr:`group_ids` as a graph input
    (:attr:`Sampler.graph_inputs`).

    Args:
        lists (`Sequence[LogitsProcessorList]`): row i's processors at index i (each checked by
            :func:`check_logits_processors`).
        device (`torch.device`, *optional*): where the scores live (for :attr:`group_ids`); CPU when omitted.
    """

    #: Rows of :attr:`group_ids` at least (a compiled step reads its first `R` rows, its rows bucket).
    MIN_GROUP_ROWS = 64

    def __init__(self, lists: Sequence[LogitsProcessorList], device: torch.device | str | None = None) -> None:
        self.lists = list(lists)
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.groups: list[LogitsProcessorList] = []
        for processors in {id(p): p for p in self.lists}.values():
            check_logits_processors(processors)
        self._index_groups()

    def __len__(self) -> int:
        return len(self.lists)

    def select(self, index: torch.Tensor | Sequence[int]) -> None:
        """Keep the rows `index` `(M,)`, in that order (in place: every sampler sharing this object follows)."""
        self.lists = [self.lists[i] for i in _as_list(index)]
        self._index_groups()

    def extend(self, lists: Sequence[LogitsProcessorList]) -> None:
        """Append the lists of rows that join the batch."""
        for processors in lists:
            check_logits_processors(processors)
        self.lists.extend(lists)
        self._index_groups()

    def _index_groups(self) -> None:
        """Register new distinct lists in :attr:`groups` and write each row's group into :attr:`group_ids`
        `(R',)` int64 (`R'` a power of two >= the rows and :data:`MIN_GROUP_ROWS`; rows past the batch: group 0)."""
        known = {id(g): k for k, g in enumerate(self.groups)}
        for processors in self.lists:
            if id(processors) not in known:
                known[id(processors)] = len(self.groups)
                self.groups.append(processors)
        rows = max(self.MIN_GROUP_ROWS, 1 << max(0, len(self.lists) - 1).bit_length())
        ids = [known[id(p)] for p in self.lists] + [0] * (rows - len(self.lists))
        self.group_ids = torch.tensor(ids, dtype=torch.long, device=self.device)
        if getattr(self, "_key_groups", None) != len(self.groups):
            self._key, self._key_groups = tuple(processors_key(g) for g in self.groups), len(self.groups)

    @property
    def key(self) -> tuple:
        """What a compiled step applying these lists specialises on: each group's :func:`processors_key` (it
        changes when a row joins with settings no row had before)."""
        return self._key

    def apply(self, scores: torch.Tensor, rows: torch.Tensor | Sequence[int] | None) -> torch.Tensor:
        """Process `scores` `(M, L, V)` float32, whose M rows are the batch rows `rows` (all rows when None; in a
        compiled step, or a step run eagerly at its rows bucket: the batch rows first, then padding)."""
        if rows is None and (recording_step() or scores.shape[0] > len(self.lists)):
            group_ids = self.group_ids[:scores.shape[0], None, None]
            out = scores
            for k, processors in enumerate(self.groups):
                processed = _apply(processors, scores.reshape(-1, scores.shape[-1])).reshape(scores.shape)
                out = torch.where(group_ids == k, processed, out)
            return out
        if rows is None and scores.shape[0] != len(self.lists):
            raise ValueError(f"RowProcessors.apply: {scores.shape[0]} rows of scores for a batch of {len(self.lists)}"
                             " rows; pass `rows`, the batch rows of the scores (Sampler.probs(logits, rows)).")
        rows = list(range(scores.shape[0])) if rows is None else _as_list(rows)
        groups: dict[int, tuple[LogitsProcessorList, list[int]]] = {}
        for k, row in enumerate(rows):
            processors = self.lists[row]
            groups.setdefault(id(processors), (processors, []))[1].append(k)
        if len(groups) == 1:
            processors = next(iter(groups.values()))[0]
            return _apply(processors, scores.reshape(-1, scores.shape[-1])).reshape(scores.shape)
        out = torch.empty_like(scores)
        for processors, members in groups.values():
            index = torch.tensor(members, device=scores.device)
            part = scores[index]
            out[index] = _apply(processors, part.reshape(-1, scores.shape[-1])).reshape(part.shape)
        return out


def step_processors(processors) -> bool:
    """Whether a compiled step can apply `processors` (the sampler's `logits_processor`): a plain
    `LogitsProcessorList` (or list) or a :class:`RowProcessors` of lists whose processors are all of
    :data:`POSITION_INDEPENDENT_PROCESSORS` (exact classes: their settings are attributes the step's key names,
    :func:`processors_key`)."""
    if type(processors) is RowProcessors:
        return all(step_processors(g) for g in processors.groups)
    return type(processors) in (LogitsProcessorList, list) and all(
        type(p) in POSITION_INDEPENDENT_PROCESSORS for p in processors)


def processors_key(processors: LogitsProcessorList) -> tuple:
    """A hashable description of `processors`: per processor its class and its attributes' values (tensors as
    tuples of their values; this reads them on the host). Two lists with equal descriptions process scores alike:
    a compiled function that calls them specialises on exactly this."""
    if isinstance(processors, RowProcessors):
        return ("per_row", processors.key)
    return tuple((type(proc).__qualname__, tuple(sorted((name, _hashable(v)) for name, v in vars(proc).items())))
                 for proc in processors)


def _hashable(value):
    if isinstance(value, torch.Tensor):
        return str(value.dtype), tuple(value.shape), tuple(value.flatten().tolist())
    if isinstance(value, dict):
        return tuple(sorted((repr(k), _hashable(v)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return tuple(_hashable(v) for v in value)
    try:
        hash(value)
    except TypeError:
        return repr(value)
    return value


#: The warpers transformers' `generate` adds for sampling, in its order (after every other processor).
_WARPERS = (TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper, MinPLogitsWarper, TypicalLogitsWarper,
            EpsilonLogitsWarper, EtaLogitsWarper)


def row_processors(call: LogitsProcessorList, *, temperature: float | None = None, top_k: int | None = None,
                   top_p: float | None = None) -> LogitsProcessorList:
    """The processors a batch-1 `generate(do_sample=True, temperature=..., top_k=..., top_p=...)` call would use,
    from the processors `call` of a call that differs only in these three settings (None: the call's own).

    transformers' `generate` appends its sampling warpers after every other processor, in the order temperature,
    top-k, top-p, min-p, typical, epsilon, eta, each only when not neutral (temperature 1, top-k 0, top-p 1); the
    three are replaced in place, with `min_tokens_to_keep=1` (no beams). Returns `call` itself when nothing changes.

    Raises:
        ValueError: from transformers' warpers, for an invalid value.
    """
    if temperature is None and top_k is None and top_p is None:
        return call
    current = {type(proc): proc for proc in call}
    if temperature is None and TemperatureLogitsWarper in current:
        temperature = current[TemperatureLogitsWarper].temperature
    if top_k is None and TopKLogitsWarper in current:
        top_k = current[TopKLogitsWarper].top_k
    if top_p is None and TopPLogitsWarper in current:
        top_p = current[TopPLogitsWarper].top_p
    own = []
    if temperature is not None and temperature != 1.0:
        own.append(TemperatureLogitsWarper(temperature))
    if top_k is not None and top_k != 0:
        own.append(TopKLogitsWarper(top_k=top_k, min_tokens_to_keep=1))
    if top_p is not None and top_p < 1.0:
        own.append(TopPLogitsWarper(top_p=top_p, min_tokens_to_keep=1))
    first = next((k for k, proc in enumerate(call) if type(proc) in _WARPERS), len(call))
    rest = [proc for proc in call[first:] if type(proc) not in _WARPERS[:3]]
    return LogitsProcessorList([*call[:first], *own, *rest])


def _apply(processors: LogitsProcessorList, scores: torch.Tensor) -> torch.Tensor:
    """`processors` on `scores` `(R, V)`, each position a row of its own (what they see in a batch-1 call)."""
    dummy_ids = torch.zeros((scores.shape[0], 1), dtype=torch.long, device=scores.device)
    for proc in processors:
        scores = proc(dummy_ids, scores)
    return scores


#: What the draws accept: one generator for the batch, one per row, or None (torch's global RNG).
Generators = torch.Generator | RowGenerators | None


def _as_list(index: torch.Tensor | Sequence[int]) -> list[int]:
    return index.tolist() if isinstance(index, torch.Tensor) else list(index)


def rows_of(generator: Generators, index: torch.Tensor | Sequence[int]) -> Generators:
    """The generators of the rows `index` `(M,)` of a batch, for a draw over those rows only; a shared generator
    (or None) is returned as is."""
    return generator.subset(index) if isinstance(generator, RowGenerators) else generator


def _check_rows(generator: RowGenerators, rows: int, what: str) -> None:
    if len(generator) != rows:
        raise ValueError(f"{what}: {len(generator)} per-row generators for {rows} rows; pass rows_of(generator, "
                         "rows) for a draw over some rows of the batch.")


def draw_categorical(probs: torch.Tensor, generator: Generators, draw: torch.Tensor | None = None) -> torch.Tensor:
    """One token per position from `probs` (`torch.multinomial`, one sample).

    Args:
        probs (`torch.Tensor` of shape `(R, *S, V)`): a distribution per position (rows first).
        generator (`torch.Generator`, `RowGenerators` or `None`): shared: one `torch.multinomial` call over every
            position in row-major order (`draw` ignored); per row: row r draws from its generator only at the
            positions `draw[r]` (all when None), in row-major order, in one call.
        draw (`torch.Tensor` of shape `(R, *S)`, bool, *optional*): the positions whose token is used (per-row
            generators only; the other positions get the argmax and consume no random number).

    Returns:
        `torch.Tensor` of shape `(R, *S)`, int64.

    Raises:
        ValueError: if a `RowGenerators` does not have `R` generators.
    """
    vocab = probs.shape[-1]
    if not isinstance(generator, RowGenerators):
        return torch.multinomial(probs.reshape(-1, vocab), 1, generator=generator).reshape(probs.shape[:-1])
    _check_rows(generator, probs.shape[0], "draw_categorical")
    flat = probs.reshape(probs.shape[0], -1, vocab)                                  # (R, P, V)
    tokens = flat.argmax(dim=-1)                                                      # (R, P)
    where = None if draw is None else draw.reshape(probs.shape[0], -1).to(probs.device)
    for r in range(flat.shape[0]):
        positions = flat[r] if where is None else flat[r][where[r]]
        if positions.shape[0]:
            picked = torch.multinomial(positions, 1, generator=generator[r])[:, 0]
            if where is None:
                tokens[r] = picked
            else:
                tokens[r, where[r]] = picked
    return tokens.reshape(probs.shape[:-1])


def categorical_from_noise(probs: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """One token per position from `probs` and exponential noise drawn beforehand: `argmax(probs / noise)`.

    What `torch.multinomial(probs, 1, generator=g)` computes (ATen's one-sample path: exponential noise
    `Exp(1)` of the shape of `probs`, drawn by `g`, then the argmax of the ratio; the exponential form of the
    Gumbel-max trick), with the noise as an input: :func:`draw_exponential` draws it as :func:`draw_categorical`
    would, so the tokens are the same and the generator advances the same, and the choice itself is a pure function
    (a compiled step, no random state inside).

    Args:
        probs (`torch.Tensor` of shape `(..., V)`): a distribution per position.
        noise (`torch.Tensor` of the same shape, float32): positive `Exp(1)` draws.

    Returns:
        `torch.Tensor` of shape `(...)`, int64.

    Source: ATen `multinomial` (aten/src/ATen/native/Distributions.cpp, "the algorithm is from gumbel softmax").
    """
    return (probs / noise).argmax(dim=-1)


def draw_exponential(noise: torch.Tensor, generator: Generators, rows: int | None = None, *,
                     widths: Sequence[int] | None = None) -> torch.Tensor:
    """Fill the first `rows` rows of `noise` `(R, *S, V)` in place with `Exp(1)` draws, in the order and amount
    :func:`draw_categorical` (with `draw=None`) would draw for a multinomial over `probs` of shape
    `(rows, *S, V)` (:func:`categorical_from_noise` then gives its tokens): a shared generator (or None, torch's
    global RNG) draws them in one call, row-major; per-row generators draw row r's `(*S, V)` from generator r.
    The other rows are left as they are (padding rows of a fixed-shape buffer). `noise` must be contiguous,
    float32 (the dtype of the probabilities) and on their device.

    With `widths` (one per row, `rows = len(widths)`), rows choose over different lengths along dim 1 (a row's
    drafts; 0: the row draws nothing, as :meth:`Sampler.choose` with `draw=` masks whole rows): per-row generators
    draw row r's first `widths[r]` positions, a shared generator the first `max(widths)` of every row in one call
    (the eager choice over the widest row). Positions past a row's width keep older numbers, never read.

    Returns:
        `noise`.

    Raises:
        ValueError: if a `RowGenerators` does not have `rows` generators.
    """
    if widths is not None:
        rows, noise_of = len(widths), noise[:, :max(widths, default=0)]
    else:
        rows, noise_of = noise.shape[0] if rows is None else rows, noise
    if not isinstance(generator, RowGenerators):
        noise_of[:rows].exponential_(1, generator=generator)
        return noise
    _check_rows(generator, rows, "draw_exponential")
    for r in range(rows):
        (noise[r] if widths is None else noise[r, :widths[r]]).exponential_(1, generator=generator[r])
    return noise


def draw_uniforms(lengths: torch.Tensor, width: int, generator: Generators, *, device: torch.device,
                  dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
    """Uniforms in [0, 1) for `R` rows of up to `width` positions (the rejection test of speculative sampling).

    Args:
        lengths (`torch.Tensor` of shape `(R,)`, int64): positions each row uses (<= `width`); read on the host
            for per-row generators only.
        width (`int`): L.
        generator (`torch.Generator`, `RowGenerators` or `None`): shared: one `torch.rand(R, L)` call; per row:
            row r draws `lengths[r]` uniforms from its generator (the rest of its row is 1.0, never read).
        out (`torch.Tensor` of shape `(R', L)`, `R' >= R`, contiguous, *optional*): filled in place (its first `R`
            rows; the same numbers as a new tensor), e.g. a compiled step's fixed buffer.

    Returns:
        `torch.Tensor` of shape `(R, L)` (`out[:R]` when given).

    Raises:
        ValueError: if a `RowGenerators` does not have `R` generators.
    """
    rows = lengths.shape[0]
    out = torch.empty(rows, width, device=device, dtype=dtype) if out is None else out[:rows]
    if not isinstance(generator, RowGenerators):
        return out.uniform_(0, 1, generator=generator)
    _check_rows(generator, rows, "draw_uniforms")
    out.fill_(1.0)
    for r, n in enumerate(lengths.tolist()):
        if n:
            out[r, :n].uniform_(0, 1, generator=generator[r])
    return out


def draw_verification(lengths: torch.Tensor, width: int, vocab: int, generator: Generators, *, device: torch.device,
                      dtype: torch.dtype, noise: bool = True,
                      out: tuple[torch.Tensor, torch.Tensor | None] | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Every random number one speculative verification of `R` rows uses, drawn before it
    (:func:`~hf_dllm_spec.maths.verification.rejection_sample`'s `draws`; its module docstring gives the order):
    the uniforms of the rejection test and, when `noise`, one `Exp(1)` draw per row for its recovered or bonus
    token, whether or not the row rejects (so the amount drawn never depends on the outcome, and a compiled step
    gets the eager tokens from the same generators).

    Args:
        lengths (`torch.Tensor` of shape `(R,)`, int64): drafts per row (<= `width`).
        width (`int`): L, the drafts' width. vocab (`int`): V.
        generator (`torch.Generator`, `RowGenerators` or `None`): shared: `torch.rand(R, L)`, then one `(R, V)`
            exponential draw; per row: row r draws its `lengths[r]` uniforms, then its `V` exponentials.
        noise (`bool`, defaults to True): False when no recovered or bonus token is drawn
            (`allow_resample=False` without a bonus).
        out (`tuple`, *optional*): buffers `(R', L)` and `(R', V)` (or None) with `R' >= R`, filled in place.

    Returns:
        `(uniforms (R, L), noise (R, V) or None)`, views of `out` when given.

    Raises:
        ValueError: if a `RowGenerators` does not have `R` generators.
    """
    rows = lengths.shape[0]
    uniforms_out, noise_out = (None, None) if out is None else out
    if noise and noise_out is None:
        noise_out = torch.empty(rows, vocab, device=device, dtype=dtype)
    if not isinstance(generator, RowGenerators):
        uniforms = draw_uniforms(lengths, width, generator, device=device, dtype=dtype, out=uniforms_out)
        return uniforms, draw_exponential(noise_out, generator, rows)[:rows] if noise else None
    _check_rows(generator, rows, "draw_verification")
    uniforms = (torch.empty(rows, width, device=device, dtype=dtype) if uniforms_out is None
                else uniforms_out[:rows]).fill_(1.0)
    for r, n in enumerate(lengths.tolist()):
        if n:
            uniforms[r, :n].uniform_(0, 1, generator=generator[r])
        if noise:
            noise_out[r].exponential_(1, generator=generator[r])
    return uniforms, noise_out[:rows] if noise else None


@dataclass
class Sampler:
    """Turns logits into the processed distribution, draws tokens and reports confidences.

    Args:
        logits_processor (`LogitsProcessorList`): transformers processors (warpers only when sampling).
        do_sample (`bool`): sample from the processed distribution (True) or take its argmax (False).
        suppress_token_ids (`list[int]`): ids that get zero probability everywhere (the mask token: a sampled
            MASK would leave the position masked; suppressing it is a documented deviation from the references).
        generator (`torch.Generator`, a list of them, `RowGenerators` or `None`): the only source of randomness;
            `None` uses torch's global RNG; a list or tuple (one per row) becomes a :class:`RowGenerators` (module
            docstring: the order of the draws).
        device (`torch.device`, *optional*): where the logits live (the suppressed ids are put there once, so a
            compiled step never sees them move); CPU when omitted (moved on first use).
    """

    logits_processor: LogitsProcessorList
    do_sample: bool
    suppress_token_ids: list[int]
    generator: Generators | Sequence[torch.Generator] = None
    device: torch.device | str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.logits_processor, RowProcessors):
            check_logits_processors(self.logits_processor)
        if isinstance(self.generator, (list, tuple)):
            self.generator = RowGenerators(self.generator)
        # The suppression SuppressTokensLogitsProcessor would apply, as one `index_fill` (no vocabulary-wide isin).
        self._suppressed = tuple(sorted(set(self.suppress_token_ids)))
        self._suppress = torch.tensor(self._suppressed, dtype=torch.long, device=self.device)
        self._plain_key: tuple = (None, ())                 # (a plain processor list, its processors_key)

    def probs(self, logits: torch.Tensor, rows: torch.Tensor | Sequence[int] | None = None) -> torch.Tensor:
        """Processed distribution per position.

        Args:
            logits (`torch.Tensor` of shape `(M, ..., V)`, e.g. `(N, B, V)`): raw logits, any float dtype. Every
                position is an independent row for the processors.
            rows (`torch.Tensor` of shape `(M,)`, *optional*): the batch rows of `logits` when not all of them
                (per-row processors).

        Returns:
            `torch.Tensor` of the same shape, float32: softmax of the processed logits. Called p (draft) or q
            (verifier) in S2D2 Algorithm 3.
        """
        return torch.softmax(self.scores(logits, rows), dim=-1)

    def greedy(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Greedy choice without the full distribution: the argmax of the processed logits and its probability.

        What :meth:`choose` returns on :meth:`probs` when not sampling (up to float rounding of the probability),
        from one max and one log-sum-exp over the vocabulary instead of a softmax written out, an argmax over it
        and a gather; for the steps whose consumers read only the chosen token and its confidence.

        Args:
            logits (`torch.Tensor` of shape `(..., V)`): raw logits, any float dtype.

        Returns:
            `(token_ids, confidence)`: int64 and float32 of shape `(...)`.

        Raises:
            ValueError: when sampling (`do_sample=True`): a draw needs the distribution.
        """
        if self.do_sample:
            raise ValueError("Sampler.greedy: the sampler draws tokens (`do_sample=True`); use probs() + choose().")
        scores = self.scores(logits)
        best, token_ids = scores.max(dim=-1)
        return token_ids, torch.exp(best - torch.logsumexp(scores, dim=-1))

    def scores(self, logits: torch.Tensor, rows: torch.Tensor | Sequence[int] | None = None) -> torch.Tensor:
        """The processed logits (suppression, then the processors in order), float32, same shape as `logits`
        `(M, ..., V)`; `rows` `(M,)`: the batch rows of its first dimension when they are not all the rows (read
        only with per-row processors, :class:`RowProcessors`)."""
        shape = logits.shape
        scores = logits.float().reshape(-1, shape[-1])
        if self._suppress.numel() and recording_step():     # not the kept ids: a graph would read this call's copy
            ids = device_constant(self._suppressed, torch.long, scores.device)
            scores = scores.index_fill(-1, ids, -float("inf"))
        elif self._suppress.numel():
            if self._suppress.device != scores.device:
                self._suppress = self._suppress.to(scores.device)
            scores = scores.index_fill(-1, self._suppress, -float("inf"))
        if isinstance(self.logits_processor, RowProcessors):
            return self.logits_processor.apply(scores.reshape(shape[0], -1, shape[-1]), rows).reshape(shape)
        return _apply(self.logits_processor, scores).reshape(shape)

    @property
    def step_key(self) -> tuple:
        """What a compiled step calling this sampler specialises on (hashable): whether it samples, the suppressed
        ids, each processor's class and settings (:func:`processors_key`). Read at every step: per-row processors
        gain a group when a row of new settings joins (:attr:`RowProcessors.key`); a plain list's key (a host read of
        its tensors) is read once per list."""
        processors = self.logits_processor
        if isinstance(processors, RowProcessors):
            return self.do_sample, self._suppressed, processors_key(processors)
        if self._plain_key[0] is not processors:
            self._plain_key = (processors, processors_key(processors))
        return self.do_sample, self._suppressed, self._plain_key[1]

    @property
    def graph_inputs(self) -> list[tuple[object, str]]:
        """The tensors a step calling this sampler reads through attributes, as `(object, attribute name)`: the
        rows' groups of per-row processors (:attr:`RowProcessors.group_ids`, replaced as rows join and leave) and
        every tensor a processor holds (`SuppressTokensLogitsProcessor.suppress_tokens`, `EtaLogitsWarper.epsilon`:
        made by each call, so a graph that kept the capturing call's would read freed memory). A CUDA graph of the
        step takes them as inputs (`StaticModelRunner.run_step`); the step's key holds their values
        (:func:`processors_key`)."""
        processors = self.logits_processor
        lists = processors.groups if isinstance(processors, RowProcessors) else [processors]
        held = [(proc, name) for group in lists for proc in group
                for name, value in vars(proc).items() if isinstance(value, torch.Tensor)]
        return [(processors, "group_ids")] * isinstance(processors, RowProcessors) + held

    def draw_noise(self, noise: torch.Tensor, rows: int) -> torch.Tensor:
        """The random draw of :meth:`choose` over `probs` of shape `(rows, *noise.shape[1:])`, made beforehand into
        the first `rows` rows of the buffer `noise` (in place, :func:`draw_exponential`); pass it to :meth:`choose`
        as `noise`. Returns `noise`."""
        return draw_exponential(noise, self.generator, rows)

    def select_rows(self, index: torch.Tensor) -> None:
        """Keep the per-row generators of the rows `index` `(M,)` that stay in the batch (no-op for a shared
        generator). Samplers sharing the generators (target and drafter) follow; call it once per selection."""
        if isinstance(self.generator, RowGenerators):
            self.generator.select(index)
        if isinstance(self.logits_processor, RowProcessors):
            self.logits_processor.select(index)

    def add_rows(self, generators: Sequence[torch.Generator | None],
                 processors: Sequence[LogitsProcessorList | None] | None = None) -> None:
        """Rows join the batch (continuous batching) with their own generators (`None` each for a greedy sampler,
        which draws nothing) and, with per-row processors, their own processors (`None`: the call's).

        Raises:
            ValueError: a sampling batch without one generator per row (a joining row's draws would come from
                another row's generator, or the global one); own processors for a sampler without per-row ones.
        """
        processors = list(processors) if processors is not None else [None] * len(generators)
        per_row = isinstance(self.logits_processor, RowProcessors)
        if any((p is None) == per_row for p in processors):
            raise invalid("processors", "<mixed>", "be given for every joining row exactly when the sampler has "
                          "per-row processors (RowProcessors)", "give every request of the call its own settings")
        if per_row:
            self.logits_processor.extend(processors)
        if not self.do_sample:
            return
        if not isinstance(self.generator, RowGenerators) or any(g is None for g in generators):
            raise invalid("generator", "shared", "be one torch.Generator per row for rows that join a sampling "
                          "batch (each row draws from its own)", "pass generator=[g_0, ...] and a generator with "
                          "every joining row")
        self.generator.extend(generators)

    def choose(self, probs: torch.Tensor, draw: torch.Tensor | None = None, *,
               noise: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Pick one token per position and report its probability (the confidence).

        Args:
            probs (`torch.Tensor` of shape `(N, ..., V)`, float32): from :meth:`probs`, rows first.
            draw (`torch.Tensor` of shape `(N, ...)`, bool, *optional*): the positions whose token the caller uses,
                when that is not all of them; with per-row generators only these consume random numbers (what the
                row's single decode draws). See :func:`draw_categorical`.
            noise (`torch.Tensor` of shape `(N, ..., V)`, float32, *optional*): when sampling, the draw made
                beforehand by :meth:`draw_noise` (:func:`categorical_from_noise`: the same tokens, and nothing
                random here, for a compiled step); `draw` is then ignored (every position was drawn).

        Returns:
            `(token_ids, confidence)`: int64 and float32 of shape `(N, ...)`, the probability of the chosen token
            under `probs`, as in SDAR's `block_diffusion_generate` (greedy: the float32 softmax probability of the
            argmax). Greedy takes the argmax; sampling draws one token per position from the generator in
            row-major order (one `torch.multinomial` call; per row with per-row generators).
        """
        if self.do_sample and noise is not None:
            token_ids = categorical_from_noise(probs, noise)
        elif self.do_sample:
            token_ids = draw_categorical(probs, self.generator, draw)
        else:
            token_ids = probs.argmax(dim=-1)
        return token_ids, probs.gather(-1, token_ids[..., None])[..., 0]


def entropy(probs: torch.Tensor) -> torch.Tensor:
    """Shannon entropy per position in nats.

    Args:
        probs (`torch.Tensor` of shape `(..., V)`).

    Returns:
        `torch.Tensor` of shape `(...)`: -sum_v p log p, with 0 log 0 = 0.
    """
    return -(probs * torch.log(probs.clamp_min(1e-30))).sum(dim=-1)


def top2_margin(probs: torch.Tensor) -> torch.Tensor:
    """Top-1 minus top-2 probability per position, `(..., V) -> (...)` (m_i in S2D2 §4.3)."""
    top = probs.topk(2, dim=-1).values
    return top[..., 0] - top[..., 1]
