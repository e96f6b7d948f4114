"""The plan of one `generate` call: every fact the decoding needs, resolved and checked once, before any forward.

:func:`build_plan` takes the model(s), the call's arguments and the generation config and returns a frozen
:class:`DecodePlan`: the strategy and its validated config (block size filled in), the mask, stop and pad ids, the
budget, the prompts' lengths, the drafter and its block size, the runtime (eager or static), the sampling mode and
generator, the stopping criteria left to scan. Every check of bad input runs while it is built (each names the
argument, its value, the rule and the fix); nothing after it validates. Strategies read the plan's values through
their config and the session :func:`~hf_dllm_spec.integration.generate.dllm_generate` builds from it.

The checks run in the order of the plan: the models (weights that can decode,
:func:`hf_dllm_spec.runtime.weights.check_weights`; a family each; the kinds of models the strategy declares,
`DecodingStrategy.target_kind` / `drafter_kind`), the inputs as given (options, ids, mask, model kwargs,
generator), the tokens and the sizes resolved (the mask token first: a model without one gets that error, not the
block size's), the drafter, then the prompts against the finished plan (:func:`_check_prompts`, which
:func:`check_row` runs on a row that joins a running call) and, with continuous batching, the row feed and its
initial requests (:func:`_check_feed`). All but the weights' are this module's own;
:mod:`~hf_dllm_spec.integration.checks` reuses them on the raw call, before transformers prepares it,
`DeerCandidateGenerator` on its drafter.

Source: issue 33 ("A plan per call").
"""

from __future__ import annotations

import dataclasses
import math
import operator
import warnings
from dataclasses import dataclass
from typing import Any

import torch
from transformers import DynamicCache, GenerationConfig

import model_patches
from model_patches.compat import CACHE_KWARG, CACHE_NAMES, cache_used, find_cache

from ..bridge import caller_stacklevel
from ..configuration import DecodingConfig
from ..maths.masks import left_padded_valid
from ..runtime.weights import check_weights
from ..runtime.static import drop_prepared_static_cache, static_cache_length
from ..strategies.base import DecodingStrategy
from ..strategies.registry import get_strategy, resolve_config
from ..validation import check_int, invalid
from .rows import RowFeed, check_request, criteria_to_scan

#: Float options of `GenerationConfig` the sampler reads; NaN or infinity is refused.
FLOAT_GENERATION_OPTIONS = ("temperature", "top_p", "min_p", "typical_p", "epsilon_cutoff", "eta_cutoff",
                            "repetition_penalty")

#: Generation options that need one output per prompt and greedy or sampled decoding of one hypothesis.
SINGLE_HYPOTHESIS = ("num_beams", "num_return_sequences", "num_beam_groups")

#: `GenerationConfig` options that select another of transformers' decoding modes
#: (`GenerationConfig.get_generation_mode`): a strategy replaces that mode, so set, they would be ignored.
MODE_OPTIONS = {"penalty_alpha": "contrastive search", "dola_layers": "DoLa decoding",
                "prompt_lookup_num_tokens": "prompt-lookup decoding", "assistant_early_exit": "early-exit decoding",
                "use_mtp": "multi-token-prediction drafting", "constraints": "constrained beam search",
                "force_words_ids": "constrained beam search"}

#: Model kwargs transformers prepares that the decoding loop reads or may ignore (it builds its own masks); the
#: cache under the name of every supported transformers version (`model_patches.compat.CACHE_NAMES`).
KNOWN_MODEL_KWARGS = {"attention_mask", "position_ids", "use_cache", "logits_to_keep", "cache_position",
                      *CACHE_NAMES}


@dataclass(frozen=True)
class DecodePlan:
    """One `generate` call, decided.

    Attributes:
        strategy (`type[DecodingStrategy]`): the class `decoding_strategy` names.
        config (`DecodingConfig`): its validated config; `block_size` is the resolved one wherever the config has
            the field.
        model, patch: the target and its family adapter; draft_model, drafter_patch: the drafter (or None).
        generation_config (`GenerationConfig`): the call's.
        device (`torch.device`): the target's execution device (where the loop's tensors live).
        lengths (`tuple[int, ...]`): each row's prompt length (without padding); batch_size (`int`): N.
        block_size (`int`): the target's block size; draft_block_size (`int` or None): the drafter's.
        mask_token_id (`int` or None), draft_mask_token_id (`int` or None): the two models' mask tokens.
        stop_ids (`tuple[int, ...]`): a row stops after one of them; pad_id (`int` or None): right padding.
        max_new_tokens (`int`): the budget per row.
        use_cache (`bool`): False recomputes every forward; static (`bool`): the static runtime;
        cache_len (`int`): static runtime: columns per row to allocate.
        do_sample (`bool`), generator: the sampling mode and the randomness (a generator, a per-row list, None).
        criteria: the stopping criteria the loop must still call (:func:`criteria_to_scan`).
        suppress_ids (`tuple[int, ...]`): token ids never sampled (the target's mask token, when it decodes with
            one: not an AR target).
        row_feed (`RowFeed` or None): continuous batching: the call's rows as requests, checked (:func:`_check_feed`).
    """

    strategy: type[DecodingStrategy]
    config: DecodingConfig
    model: Any
    patch: Any
    draft_model: Any
    drafter_patch: Any
    generation_config: GenerationConfig
    device: torch.device
    lengths: tuple[int, ...]
    block_size: int
    draft_block_size: int | None
    mask_token_id: int | None
    draft_mask_token_id: int | None
    stop_ids: tuple[int, ...]
    pad_id: int | None
    max_new_tokens: int
    use_cache: bool
    static: bool
    cache_len: int
    do_sample: bool
    generator: Any
    criteria: Any
    suppress_ids: tuple[int, ...]
    row_feed: RowFeed | None = None

    @property
    def denoising_mask_id(self) -> int | None:
        """The mask token the target is denoised with (`int`), or None where the call decodes the target without
        one (AR on a right-shifted model): the token `suppress_ids` holds."""
        return self.suppress_ids[0] if self.suppress_ids else None

    @property
    def batch_size(self) -> int:
        """N, the rows the call starts with (`int`; one per entry of `lengths`)."""
        return len(self.lengths)


def build_plan(model, input_ids: torch.Tensor, generation_config: GenerationConfig, model_kwargs: dict[str, Any], *,
               decoding_strategy: str, overrides: dict[str, Any], strategy_config: DecodingConfig | None,
               preset: str | None, draft_model, mask_token_id: int | None, draft_mask_token_id: int | None,
               generator, streamer, stopping_criteria, raw_attention_mask=None,
               row_feed: RowFeed | None = None) -> DecodePlan:
    """Resolve and check one call (see the module docstring): the models, the inputs as given, the tokens, the
    sizes, the drafter, in that order; `model_kwargs` loses the static cache transformers prepared for
    `cache_implementation="static"` (the static runtime keeps its own).

    Raises:
        ValueError: the first bad argument, before any forward (unknown strategy, bad parameter, right padding,
            missing mask token, budget < 1, a prompt beyond the model's positions, a streamer with batch > 1, a
            drafter where none is used or none where one is needed, a drafter of another vocabulary, a random
            acceptance rule under `do_sample=False` without a `generator`, ...).
        NotImplementedError: an unsupported model family.
    """
    strategy = get_strategy(decoding_strategy)
    config = resolve_config(strategy.name, generation_config=generation_config, strategy_config=strategy_config,
                            preset=preset, overrides=overrides)
    device, patch, drafter_patch = _check_models(strategy, model, draft_model)
    lengths = _check_inputs(input_ids, generation_config, model_kwargs, device=device, generator=generator,
                            streamer=streamer, raw_attention_mask=raw_attention_mask)
    do_sample = bool(generation_config.do_sample)
    _check_acceptance(config, do_sample, generator)
    needs_mask = _needs_mask(strategy, patch, model)
    mask, stop_ids, pad_id = _resolve_tokens(strategy, patch, model, input_ids, lengths, generation_config,
                                             mask_token_id, draft_mask_token_id, needs_mask)
    config, block_size, max_new_tokens = _resolve_sizes(patch, model, config, input_ids, generation_config)
    draft_mask, draft_block_size = _resolve_drafter(strategy, config, model, patch, draft_model, drafter_patch,
                                                    input_ids, lengths, generation_config, stop_ids, block_size,
                                                    draft_mask_token_id)
    plan = DecodePlan(
        strategy=strategy, config=config, model=model, patch=patch, draft_model=draft_model,
        drafter_patch=drafter_patch, generation_config=generation_config, device=device, lengths=tuple(lengths),
        block_size=block_size, draft_block_size=draft_block_size, mask_token_id=mask, draft_mask_token_id=draft_mask,
        stop_ids=tuple(stop_ids), pad_id=pad_id, max_new_tokens=max_new_tokens,
        use_cache=generation_config.use_cache is not False,          # None (unset) means the default: cached
        static=generation_config.cache_implementation == "static",
        cache_len=static_cache_length(input_ids.shape[1], max_new_tokens, max(block_size, draft_block_size or 0)),
        do_sample=do_sample, generator=generator,
        criteria=criteria_to_scan(stopping_criteria, stop_ids, input_ids.shape[1], max_new_tokens),
        suppress_ids=(mask,) if mask is not None and needs_mask else (), row_feed=row_feed)
    _check_prompts(plan, input_ids, lengths, max_new_tokens)
    if row_feed is not None:
        _check_feed(plan, row_feed, streamer)
    return plan


def _check_feed(plan: DecodePlan, feed: RowFeed, streamer) -> None:
    """Continuous batching (`row_feed`), checked against the plan: a :class:`RowFeed` whose initial requests are
    the rows of `input_ids`, no stopping criteria or stop strings (each row ends at its own budget and stop ids), no
    streamer (each request streams through its `on_tokens`), one generator per row when sampling (joining rows
    bring their own), and every initial request as a joining one is checked (:func:`check_request`).

    Raises:
        ValueError: the first of these that fails.
    """
    if not isinstance(feed, RowFeed):
        raise invalid("row_feed", type(feed).__name__, "be a hf_dllm_spec.integration.rows.RowFeed",
                      "subclass RowFeed (take) and pass its instance")
    if len(feed.initial) != plan.batch_size or any(len(r.prompt_ids) != n for r, n in zip(feed.initial, plan.lengths)):
        raise invalid("row_feed", f"<{len(feed.initial)} initial requests>", f"hold one request per row of input_ids "
                      f"({plan.batch_size}), with the row's prompt", "build the feed from the same prompts")
    if plan.criteria:
        name = {"MaxTimeCriteria": "max_time", "StopStringCriteria": "stop_strings"}.get(
            type(plan.criteria[0]).__name__, "stopping_criteria")             # what transformers built it from
        raise invalid(name, type(plan.criteria[0]).__name__, "not be combined with `row_feed` (each row ends at "
                      "its own budget and stop ids; cancel a row through its request's `cancelled`)",
                      f"drop `{name}`")
    if streamer is not None:
        raise invalid("streamer", type(streamer).__name__, "not be combined with `row_feed` (each request streams "
                      "through its on_tokens)", "drop `streamer`")
    if plan.do_sample and not isinstance(plan.generator, (list, tuple)):
        raise invalid("generator", type(plan.generator).__name__, "be one torch.Generator per row with `row_feed` "
                      "and do_sample=True (joining rows bring their own)", "pass generator=[g_0, ...]")
    for request in feed.initial:
        check_request(request, plan.strategy, plan.do_sample, lambda ids, budget: check_row(plan, ids, budget))


def _check_models(strategy, model, draft_model) -> tuple[torch.device, Any, Any]:
    """The models, checked: real weights (the target's execution device, not `model.device`, which is "meta" under
    accelerate offload), quantized weights that can decode, a family adapter each, of the kinds the strategy
    declares (:func:`check_model_kinds`). Returns `(device, patch, drafter_patch or None)`."""
    device = check_weights(model, "model")
    if draft_model is not None:
        check_weights(draft_model, "draft_model")
    patch = model_patches.get_patch(model)
    drafter_patch = model_patches.get_patch(draft_model) if draft_model is not None else None
    check_model_kinds(strategy, model, patch, draft_model, drafter_patch)
    return device, patch, drafter_patch


def check_model_kinds(strategy: type[DecodingStrategy], model, patch, draft_model, drafter_patch) -> None:
    """The models against the kinds the strategy declares (`DecodingStrategy.target_kind` / `drafter_kind`): an
    autoregressive target (a right-shifted causal LM that is no diffusion LM), diffusion LMs, a drafter of the
    target's family and alignment. A strategy's other requirements are refused when it starts (its `__init__`,
    before any forward).

    Args:
        strategy (`type[DecodingStrategy]`): the strategy class.
        model, patch: the target and its family adapter; draft_model, drafter_patch: the drafter (or None).

    Raises:
        ValueError: naming `model` or `draft_model`, the rule and the fix.
    """
    same_family = strategy.drafter_kind == "same_family"
    kinds = [("model", model, patch, strategy.target_kind)]
    if draft_model is not None:
        kinds.append(("draft_model", draft_model, drafter_patch, "diffusion" if same_family else strategy.drafter_kind))
    for name, m, p, kind in kinds:
        if kind == "autoregressive" and (p.is_diffusion_lm or p.alignment_of(m) != "right_shift"):
            fix = "pass the AR model as the model"
            raise invalid(name, type(m).__name__, "be an autoregressive causal LM (right-shifted, not a diffusion LM; "
                          f"e.g. Qwen2/Qwen3) for decoding_strategy={strategy.name!r}",
                          fix + " and the diffusion model as draft_model=" if strategy.uses_drafter else fix)
        if kind == "diffusion" and not p.is_diffusion_lm:
            fix = "use block-diffusion models (SDAR, Fast-dLLM v2, LLaDA2)"
            raise invalid(name, type(m).__name__, f"be a diffusion LM for decoding_strategy={strategy.name!r}",
                          fix + " of one family for both" if same_family else fix)
    if draft_model is not None and same_family and (
            type(drafter_patch) is not type(patch)
            or drafter_patch.alignment_of(draft_model) != patch.alignment_of(model)):
        raise invalid("draft_model", type(draft_model).__name__, f"be of the target's family ({patch.family}) and "
                      "alignment", "pass a smaller model of the same family and tokenizer")


def _check_inputs(input_ids, generation_config, model_kwargs, *, device, generator, streamer,
                  raw_attention_mask) -> list[int]:
    """The call's inputs as given (options, inputs, streamer, model kwargs, generator); each row's prompt length.
    `model_kwargs` loses the static cache transformers prepared for `cache_implementation="static"` (the static
    runtime keeps its own)."""
    check_generation_config(generation_config)
    check_inputs_embeds(model_kwargs.get("inputs_embeds"))
    check_attention_mask(input_ids, raw_attention_mask)
    check_streamer(streamer)
    if streamer is not None and input_ids.shape[0] > 1:
        raise invalid("streamer", type(streamer).__name__, "be used with batch size 1 (transformers' streamers "
                      f"follow one sequence; got {input_ids.shape[0]} rows)",
                      "decode one prompt at a time when streaming, or drop `streamer`")
    if streamer is not None and getattr(streamer, "_takes_logits", False):
        raise invalid("streamer", type(streamer).__name__, "not ask for draft logits (`_takes_logits=True`): "
                      "drafts are sent as token ids", "set `streamer._takes_logits = False`")
    lengths = prompt_lengths(input_ids, model_kwargs.get("attention_mask"))
    drop_prepared_static_cache(generation_config, model_kwargs)
    check_model_kwargs(input_ids, model_kwargs, lengths)
    check_generator(generator, device, input_ids.shape[0])
    return lengths


def _resolve_sizes(patch, model, config, input_ids, generation_config):
    """`(config, block size, budget)`: the block size (given, else the checkpoint's trained one) written into the
    config (`max_cache_len` checked against the model's positions), and the budget `max_new_tokens` (the prompts
    are checked against both with the finished plan, :func:`_check_prompts`)."""
    block_size = _resolve_block_size(patch, model, getattr(config, "block_size", None))
    ceiling, max_positions = getattr(generation_config, "max_cache_len", None), patch.max_positions(model)
    if ceiling is not None and max_positions is not None and ceiling > max_positions:
        raise invalid("max_cache_len", ceiling, f"be at most the model's {max_positions} positions (the static "
                      "cache is never filled beyond them)", f"pass max_cache_len <= {max_positions}, or drop it")
    if "block_size" in {f.name for f in dataclasses.fields(config)} and config.block_size != block_size:
        config = dataclasses.replace(config, block_size=block_size)      # validates against the block size
    return config, block_size, _resolve_budget(input_ids, generation_config)


def _check_acceptance(config: DecodingConfig, do_sample: bool, generator) -> None:
    """Greedy means greedy: a random acceptance rule (rejection sampling of the drafts) under `do_sample=False`
    only with an explicit `generator` (the reference codes' random acceptance of argmax drafts, reproducible); no
    parameter the rule of the sampling mode ignores (`DecodingConfig.check_acceptance`)."""
    config.check_acceptance(do_sample)
    stochastic = config.stochastic_acceptance()
    if stochastic is None or do_sample or generator is not None:
        return
    name, value = stochastic
    raise invalid(name, value, "come with do_sample=True: under do_sample=False decoding is greedy and "
                  "deterministic, and this acceptance rule draws random numbers",
                  f"drop `{name}` (greedy match under do_sample=False), pass do_sample=True, or pass an explicit "
                  "generator=torch.Generator().manual_seed(...) to reproduce the reference code's random acceptance "
                  "of argmax drafts")


def _resolve_budget(input_ids: torch.Tensor, generation_config: GenerationConfig) -> int:
    if generation_config.max_new_tokens is not None:
        check_int("max_new_tokens", generation_config.max_new_tokens, 1, "pass e.g. max_new_tokens=64")
        return generation_config.max_new_tokens
    length = generation_config.max_length or 20      # transformers' default max_length is 20 when nothing is set
    check_int("max_length", length, 1, "pass max_new_tokens instead, e.g. max_new_tokens=64")
    if length - input_ids.shape[1] < 1:
        raise invalid("max_length", length, "leave room for at least one new token", "pass max_new_tokens >= 1")
    return length - input_ids.shape[1]


def _resolve_block_size(patch, model, block_size: int | None, name: str = "block_size") -> int:
    trained = patch.trained_block_size(model)
    resolved = block_size if block_size is not None else trained
    if resolved is None:
        raise invalid(name, None, f"be given: model_type `{model.config.model_type}` has no trained block size in "
                      "its config", f"pass {name}=4 (or the size the model was trained with)")
    if trained is not None and resolved not in (1, trained):
        warnings.warn(
            f"`{name}` (={resolved}) differs from the checkpoint's trained block size (={trained}) for "
            f"model_type `{model.config.model_type}`: running off-distribution.", stacklevel=caller_stacklevel(),
        )
    max_positions = patch.max_positions(model)
    if max_positions is not None and resolved > max_positions:
        raise invalid(name, resolved, f"fit in the model's {max_positions} positions",
                      f"pass a block size <= {max_positions} (the checkpoint's trained size is {trained})")
    return resolved


def _resolve_tokens(strategy, patch, model, input_ids, lengths, generation_config, mask_token_id,
                    draft_mask_token_id, needs_mask: bool):
    """`(mask id or None, stop ids, pad id or None)` of the target, checked against the prompts (the mask ids given:
    integers; `needs_mask`: :func:`_needs_mask`)."""
    check_token_id("mask_token_id", mask_token_id, "pass the mask token's integer id (e.g. `tokenizer.mask_token_id`)")
    check_token_id("draft_mask_token_id", draft_mask_token_id, "pass the drafter's mask token's integer id")
    if mask_token_id is not None and not needs_mask and mask_token_id != patch.mask_token_id(model, None):
        raise invalid("mask_token_id", mask_token_id, f"be unset (or the model's own) for decoding_strategy="
                      f"{strategy.name!r} on model_type `{model.config.model_type}`, which decodes the target "
                      "without a mask token", "drop `mask_token_id`; the drafter's mask token is "
                      "`draft_mask_token_id`")
    mask = patch.mask_token_id(model, mask_token_id)
    if needs_mask and mask is None:
        raise invalid("mask_token_id", None, f"be known for decoding_strategy={strategy.name!r}: "
                      f"model_type `{model.config.model_type}` has no `mask_token_id` in its config or generation "
                      "config", "pass mask_token_id=<id> to generate, or set config.mask_token_id")
    stop_ids = patch.stop_token_ids(model, generation_config)
    pad_id = generation_config.pad_token_id if generation_config.pad_token_id is not None else (
        stop_ids[0] if stop_ids else None)
    if input_ids.shape[0] > 1 and pad_id is None:
        raise invalid("pad_token_id", None, "be set to right-pad rows that finish early in a batch",
                      "pass pad_token_id=<id> (transformers uses the eos id) or set generation_config.pad_token_id")
    return mask, stop_ids, pad_id


def _needs_mask(strategy, patch, model) -> bool:
    """Whether the strategy denoises the target with its mask token (not AR decoding of a right-shifted model)."""
    return strategy.requires_mask_token and not (strategy.name == "ar" and patch.alignment_of(model) == "right_shift")


def _resolve_drafter(strategy, config, model, patch, draft_model, drafter_patch, input_ids, lengths,
                     generation_config, stop_ids, block_size, draft_mask_token_id):
    """`(drafter mask id or None, drafter block size or None)`, the pair checked (vocabulary, ids, block sizes)."""
    if draft_model is not None and not strategy.uses_drafter:
        raise invalid("draft_model", type(draft_model).__name__,
                      f"be None for decoding_strategy={strategy.name!r}, which drafts with the target itself",
                      "drop `draft_model` / `assistant_model`, or pick a strategy that uses a drafter")
    if not strategy.uses_drafter:
        return None, None
    if draft_model is None:
        raise invalid("draft_model", None, f"be given for decoding_strategy={strategy.name!r}",
                      "pass draft_model=<a smaller model of the same tokenizer>")
    check_model_pair(model, patch, draft_model, drafter_patch, generation_config)
    draft_mask = drafter_patch.mask_token_id(draft_model, draft_mask_token_id)
    if strategy.requires_draft_mask_token and draft_mask is None:
        raise invalid("draft_mask_token_id", None, f"be known for decoding_strategy={strategy.name!r}: the drafter "
                      f"(model_type `{draft_model.config.model_type}`) has no `mask_token_id`",
                      "pass draft_mask_token_id=<id>, or set draft_model.config.mask_token_id")
    check_drafter_tokens(draft_model.get_input_embeddings().num_embeddings, mask_token_id=draft_mask,
                         sep_token_id=getattr(config, "sep_token_id", None), stop_ids=stop_ids)
    draft_block_size = getattr(config, "draft_block_size", None) or drafter_patch.trained_block_size(draft_model)
    strategy.check_block_sizes(block_size, draft_block_size)
    return draft_mask, draft_block_size


def check_row(plan: DecodePlan, prompt_ids: torch.Tensor, max_new_tokens: int) -> None:
    """The checks of one more row of a planned call (a request that joins a running batch, continuous batching):
    the checks of the call's own rows (:func:`_check_prompts`) on this one.

    Args:
        prompt_ids (`torch.Tensor` of shape `(P,)`, int64): the row's prompt. max_new_tokens (`int`): its budget.

    Raises:
        ValueError: as :func:`build_plan` for the same row.
    """
    _check_prompts(plan, prompt_ids[None], [prompt_ids.shape[0]], max_new_tokens)


def _check_prompts(plan: DecodePlan, input_ids: torch.Tensor, lengths: list[int], max_new_tokens: int) -> None:
    """The prompts `(N, P)` (left-padded, `lengths` real tokens each) against a plan: a block no larger than the
    whole sequence (:func:`check_block_budget`), every row's prompt and budget, decoded in whole blocks, within the
    model's positions, the token ids (and the plan's special ids) within the vocabulary, the mask token not a stop
    id, neither model's mask token in a prompt (infilling is not supported: the prompt is returned as given)."""
    block_size, mask, stop_ids = plan.block_size, plan.mask_token_id, list(plan.stop_ids)
    if plan.strategy.decodes_whole_blocks:
        check_block_budget(block_size, plan.patch.trained_block_size(plan.model), lengths, max_new_tokens)
    max_positions = plan.patch.max_positions(plan.model)
    needed = max(-(-(n + max_new_tokens) // block_size) * block_size for n in lengths)   # end of the last block
    if max_positions is not None and needed > max_positions:
        raise invalid("input_ids", f"<prompt of {max(lengths)} tokens>",
                      f"fit with max_new_tokens={max_new_tokens}, decoded in whole blocks of {block_size} "
                      f"(up to position {needed}), in the model's {max_positions} positions",
                      "shorten the prompt or lower max_new_tokens")
    room = 2 * max(block_size, plan.draft_block_size or 0)      # read-only queries held in the cache at once
    for name, model, patch in (("model", plan.model, plan.patch), ("draft_model", plan.draft_model,
                                                                   plan.drafter_patch)):
        window = patch.attention_window(model) if model is not None else None
        if window is not None and needed + room > window:
            raise invalid("input_ids", f"<prompt of {max(lengths)} tokens>",
                          f"fit with max_new_tokens={max_new_tokens}, decoded in whole blocks of {block_size} (up to "
                          f"position {needed}) plus {room} read-only query positions, in the sliding attention window "
                          f"of `{name}` ({window} positions): the decoding loop attends with full masks and rolls "
                          "the cache back, which sliding layers allow only inside it",
                          "shorten the prompt or lower max_new_tokens, or decode this model with stock generate")
    vocab_size = plan.model.get_input_embeddings().num_embeddings
    tokens = input_ids[left_padded_valid(lengths, input_ids.shape[1], input_ids.device)]
    low, high = int(tokens.min()), int(tokens.max())
    if low < 0 or high >= vocab_size:
        raise invalid("input_ids", f"<ids from {low} to {high}>", f"lie in [0, {vocab_size}) (the model's vocabulary)",
                      "tokenize with the model's own tokenizer")
    for name, ids in (("mask_token_id", [mask] if mask is not None else []), ("eos_token_id", stop_ids),
                      ("pad_token_id", [plan.pad_id] if plan.pad_id is not None else [])):
        bad = [i for i in ids if not 0 <= i < vocab_size]
        if bad:
            raise invalid(name, bad[0] if len(ids) == 1 else ids, f"lie in [0, {vocab_size}) (the model's vocabulary)",
                          "pass the id the model's tokenizer uses")
    mask = plan.denoising_mask_id                                       # None: AR on a right-shifted model
    if mask is not None and mask in stop_ids:
        raise invalid("mask_token_id", mask, f"differ from the stop ids {stop_ids}",
                      "pass the model's mask token, not its end-of-sequence token")
    for whose, token in (("", mask), ("drafter's ", plan.draft_mask_token_id)):
        if token is not None and bool((tokens == token).any()):
            raise invalid("input_ids", f"<prompt holding the {whose}mask token {token}>",
                          f"not contain the {whose}mask token (infilling a prompt is not supported: the prompt is "
                          "returned as given)", "remove the mask tokens from the prompt")



def check_inputs_embeds(inputs_embeds: Any) -> None:
    """Raise if `inputs_embeds` is given: the strategies decode from token ids (the block grid, the mask token, the
    drafter's input and the output all are ids; transformers would hand over an empty `input_ids`).

    Raises:
        ValueError: naming `inputs_embeds`.
    """
    if inputs_embeds is not None:
        shown = (f"tensor of shape {tuple(inputs_embeds.shape)}" if isinstance(inputs_embeds, torch.Tensor)
                 else type(inputs_embeds).__name__)
        raise invalid("inputs_embeds", f"<{shown}>", "not be given: hf_dllm_spec strategies decode from token ids "
                      "and do not support `inputs_embeds`", "pass `input_ids` (the tokenizer's ids) instead")


def check_attention_mask(input_ids: torch.Tensor, attention_mask: Any) -> None:
    """The `attention_mask` of the call as given, before transformers prepares it (transformers derives
    `position_ids` from it and drops an all-ones mask, so a bad mask would otherwise surface as bad positions).

    Args:
        input_ids (`torch.LongTensor` of shape `(N, P)`): the prompts.
        attention_mask (`torch.Tensor`, *optional*): the mask as the caller passed it.

    Raises:
        ValueError: naming `attention_mask`: not a tensor, on the meta device, not of the shape of `input_ids`,
            or holding values other than 0 and 1.
    """
    if attention_mask is None:
        return
    fix = "pass the mask the tokenizer returned with the ids (`return_tensors='pt'`)"
    if not isinstance(attention_mask, torch.Tensor):
        raise invalid("attention_mask", f"<{type(attention_mask).__name__}>", "be a torch.Tensor of shape "
                      "(batch_size, prompt_len)", fix)
    if attention_mask.device.type == "meta":
        raise invalid("attention_mask", f"<tensor of shape {tuple(attention_mask.shape)} on the meta device>",
                      "hold real values", fix)
    if attention_mask.shape != input_ids.shape:
        raise invalid("attention_mask", f"<tensor of shape {tuple(attention_mask.shape)}>",
                      f"have the shape of `input_ids` {tuple(input_ids.shape)}", fix)
    if not bool(((attention_mask == 0) | (attention_mask == 1)).all()):
        values = torch.unique(attention_mask).tolist()
        raise invalid("attention_mask", f"<values {values[:6]}{' ...' if len(values) > 6 else ''}>",
                      "hold only 0 (padding) and 1 (real tokens)", fix)


def check_token_id(name: str, value: Any, fix: str) -> None:
    """Raise unless `value` is `None` or an integer (a Python or NumPy int, or an integer 0-d tensor); a float or a
    string is never truncated or parsed into an id.

    Raises:
        ValueError: naming `name`.
    """
    if value is None:
        return
    try:
        if isinstance(value, bool):
            raise TypeError
        operator.index(value)
    except TypeError:
        raise invalid(name, value, "be an integer token id", fix) from None


def check_vocabulary(target, target_patch, drafter, drafter_patch, name: str = "draft_model") -> None:
    """Raise unless the drafter's distribution has the target's size (the first check of a pair, so a drafter of
    another tokenizer is named as such, before transformers' advice on `assistant_tokenizer`, which does not apply).

    Raises:
        ValueError: naming `name` (the drafter's argument).
    """
    v_target, v_drafter = target_patch.vocab_size(target), drafter_patch.vocab_size(drafter)
    if v_target != v_drafter:
        raise invalid(name, f"<vocabulary of {v_drafter} tokens>", f"share the target's vocabulary of {v_target} "
                      "tokens", "use a drafter trained with the target's tokenizer (same embedding size)")


def check_drafter_tokens(vocab_size: int, *, mask_token_id: int | None, sep_token_id: int | None = None,
                         stop_ids: list[int] = (), mask_name: str = "draft_mask_token_id") -> None:
    """The drafter's own ids against the drafter's vocabulary and the stop ids of the call.

    Args:
        vocab_size (`int`): rows of the drafter's input embedding.
        mask_token_id (`int`, *optional*): the resolved drafter mask token; `mask_name` is the argument that sets it.
        sep_token_id (`int`, *optional*): DEER's SEP token.
        stop_ids (`list[int]`): the stop ids of the call (both models stop on them).

    Raises:
        ValueError: an id outside `[0, vocab_size)`; the mask token among the stop ids; the SEP token equal to the
            mask token.
    """
    for name, value in ((mask_name, mask_token_id), ("sep_token_id", sep_token_id)):
        if value is not None and not 0 <= value < vocab_size:
            raise invalid(name, value, f"lie in [0, {vocab_size}) (the drafter's vocabulary)",
                          "pass the id the drafter's tokenizer uses")
    if mask_token_id is not None and mask_token_id in stop_ids:
        raise invalid(mask_name, mask_token_id, f"differ from the stop ids {list(stop_ids)}",
                      f"pass the drafter's mask token as {mask_name}, not an end-of-sequence token")
    if sep_token_id is not None and sep_token_id == mask_token_id:
        raise invalid("sep_token_id", sep_token_id, f"differ from the drafter's mask token ({mask_token_id})",
                      "pass the drafter's SEP token, or None for no SEP")


def check_block_budget(block_size: int, trained_block_size: int | None, lengths: list[int],
                       max_new_tokens: int) -> None:
    """Refuse a block larger than the whole sequence: at most the shortest prompt plus `max_new_tokens`, rounded up
    to a power of two (or the checkpoint's trained block size, always accepted). The shortest prompt: a batch is
    accepted exactly when each of its prompts is accepted alone.

    A block is denoised whole (one forward per step, `steps_per_block` = the block size by default) while only the
    first `max_new_tokens` positions after the prompt are kept; a block larger than the sequence adds only positions
    that are denoised and thrown away (`block_size=2048` with `max_new_tokens=16` ran 2021 forwards).

    Raises:
        ValueError: naming `block_size`.
    """
    sequence = min(lengths) + max_new_tokens
    limit = max(1 << (sequence - 1).bit_length(), trained_block_size or 1)
    if block_size > limit:
        trained = (f" (the checkpoint's trained block size, {trained_block_size}, is always accepted)"
                   if trained_block_size else "")
        raise invalid("block_size", block_size, f"be at most {limit}, the whole sequence (prompt of {min(lengths)} "
                      f"tokens + max_new_tokens={max_new_tokens}) rounded up to a power of two{trained}: a larger "
                      "block's positions past the budget are denoised, up to one forward each, and discarded",
                      f"pass block_size <= {limit}, or raise max_new_tokens")


def prompt_lengths(input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> list[int]:
    """Real tokens per row of a left-padded batch.

    Args:
        input_ids (`torch.LongTensor` of shape `(N, P)`).
        attention_mask (`torch.Tensor` of shape `(N, P)` or `None`): 1 for real tokens.

    Returns:
        `list[int]`: the number of real tokens of each row.

    Raises:
        ValueError: for an empty prompt, a shape mismatch, right padding or holes, or a row without tokens.
    """
    n, width = input_ids.shape
    if width == 0:
        raise invalid("input_ids", f"<tensor of shape {(n, width)}>", "hold at least one prompt token per row",
                      "pass a non-empty prompt (e.g. the tokenizer's BOS token)")
    if attention_mask is None:
        return [width] * n
    if attention_mask.shape != input_ids.shape:
        raise invalid("attention_mask", tuple(attention_mask.shape), f"have the shape of `input_ids` {(n, width)}",
                      "pass the mask the tokenizer returned with the ids")
    mask = attention_mask.bool()
    lengths = mask.sum(dim=1)
    if not bool((mask == left_padded_valid(lengths, width, mask.device)).all()):
        raise invalid("attention_mask", "<right padding or holes>",
                      "pad on the left, as transformers pads decoder-only models",
                      "set `tokenizer.padding_side = 'left'` before tokenizing the batch")
    if bool((lengths == 0).any()):
        raise invalid("attention_mask", "<a row without tokens>", "leave at least one real token per row",
                      "drop empty prompts from the batch")
    return lengths.tolist()


def check_single_hypothesis(name: str, value: Any) -> None:
    """Raise unless `value` (of `num_beams`, `num_return_sequences`, `num_beam_groups`) is unset or 1."""
    if value is not None and value != 1:
        raise invalid(name, value, "be 1 for hf_dllm_spec strategies (one hypothesis per prompt)",
                      f"drop `{name}`; to draw several samples, repeat the prompt in the batch with "
                      "`do_sample=True`" if name == "num_return_sequences" else f"drop `{name}`")


def check_streamer(streamer) -> None:
    """A streamer is an object with transformers' `BaseStreamer` methods `put(ids)` and `end()` (or None).

    Raises:
        ValueError: anything else (a list of streamers, a tokenizer, ...).
    """
    if streamer is not None and not all(callable(getattr(streamer, name, None)) for name in ("put", "end")):
        raise invalid("streamer", type(streamer).__name__, "have transformers' streamer methods put(ids) and end() "
                      "(`BaseStreamer`)", "pass e.g. TextStreamer(tokenizer), or one object with both methods")


def check_cache_implementation(value, max_cache_len=None) -> None:
    """The cache the strategies decode over: `cache_implementation` (`value`) unset, "dynamic" (the eager runtime) or
    "static" (the static runtime), and transformers' `max_cache_len` (the static cache sized once for the calls to
    come) unset or an integer >= 1.

    Raises:
        ValueError: any other `cache_implementation` ("offloaded", "paged", ...), or any other `max_cache_len`
            (transformers compares it with the call's length unchecked).
    """
    if value not in (None, "dynamic", "static"):
        raise invalid("cache_implementation", value,
                      "be unset, 'dynamic' (the eager runtime over a DynamicCache) or 'static' (the static runtime: "
                      "a preallocated cache, CUDA graphs on GPU) for hf_dllm_spec strategies",
                      "drop `cache_implementation`, or pass cache_implementation='static'")
    if max_cache_len is not None:
        check_int("max_cache_len", max_cache_len, 1, "pass the largest prompt + max_new_tokens you expect, e.g. "
                  "max_cache_len=4096, or drop it")


def check_generation_config(generation_config: GenerationConfig) -> None:
    """Generation options the strategies do not support, and non-finite float options.

    Raises:
        ValueError: `num_beams`/`num_return_sequences` > 1, `output_scores`-like flags, an option that selects
            another decoding mode (:data:`MODE_OPTIONS`: `penalty_alpha`, `dola_layers`, `prompt_lookup_num_tokens`,
            ...), `is_assistant`, `prefill_chunk_size` (chunked prefill is not implemented), NaN or infinite
            `temperature`, `top_p`, `min_p`, ... ; a `cache_implementation` other than unset, "dynamic" or
            "static"; "static" with `use_cache=False`; a `max_cache_len` that is not an integer >= 1.
    """
    for name in SINGLE_HYPOTHESIS:
        check_single_hypothesis(name, getattr(generation_config, name, None))
    for flag in ("output_scores", "output_logits", "output_attentions", "output_hidden_states"):
        if getattr(generation_config, flag, False):
            raise invalid(flag, True, "be False for hf_dllm_spec strategies (per-token scores are not defined "
                          "for out-of-order commits)", f"drop `{flag}`; `return_dict_in_generate=True` "
                          "returns the statistics")
    for name, mode in MODE_OPTIONS.items():
        value = getattr(generation_config, name, None)
        if value is not None and value is not False and not (name == "penalty_alpha" and value == 0):
            raise invalid(name, value, f"be unset for hf_dllm_spec strategies (it selects transformers' {mode}, "
                          "which `decoding_strategy` replaces: it would be ignored)", f"drop `{name}`")
    if getattr(generation_config, "is_assistant", False):
        raise invalid("is_assistant", True, "be unset for hf_dllm_spec strategies (transformers sets it on the "
                      "assistant of its assisted decoding, whose confidence criterion reads per-token scores)",
                      "drop `is_assistant`; to draft for a stock target, pass this model as its `assistant_model`")
    for name in FLOAT_GENERATION_OPTIONS:
        value = getattr(generation_config, name, None)
        if isinstance(value, float) and not math.isfinite(value):
            raise invalid(name, value, "be a finite number", f"pass a finite `{name}` or drop it")
    if getattr(generation_config, "prefill_chunk_size", None) is not None:
        raise invalid("prefill_chunk_size", generation_config.prefill_chunk_size, "be unset for hf_dllm_spec "
                      "strategies (each strategy prefills the prompt in one forward into its own cache: a chunk size "
                      "would be ignored)", "drop `prefill_chunk_size`")
    check_cache_implementation(generation_config.cache_implementation,
                               getattr(generation_config, "max_cache_len", None))
    if generation_config.cache_implementation == "static" and generation_config.use_cache is False:
        raise invalid("use_cache", False, "be True with cache_implementation='static' (the static runtime decodes "
                      "over its preallocated cache)", "drop `use_cache=False`, or drop `cache_implementation`")


def check_model_kwargs(input_ids: torch.Tensor, model_kwargs: dict[str, Any], lengths: list[int]) -> None:
    """Model kwargs transformers prepared: only a mask, consistent positions and an empty dynamic cache.

    Raises:
        ValueError: unknown model kwargs, `position_ids` that do not follow the attention mask, a cache (under the
            name of any supported transformers version, :data:`model_patches.compat.CACHE_NAMES`) that is not a
            `DynamicCache`, one that was used before (:func:`model_patches.compat.cache_used`), or two caches under
            both names.
    """
    unknown = sorted(set(model_kwargs) - KNOWN_MODEL_KWARGS)
    if unknown:
        raise invalid("model_kwargs", unknown, "be empty for hf_dllm_spec strategies",
                      "drop these arguments (the decoding loop builds its own inputs)")
    cache = find_cache(model_kwargs)
    if cache is not None and type(cache) is not DynamicCache:
        raise invalid(CACHE_KWARG, type(cache).__name__, "be an empty DynamicCache (or unset): the decoding "
                      "loop stores, reads and crops blocks", f"drop `cache_implementation` / `{CACHE_KWARG}`")
    if cache is not None and cache_used(cache):
        raise invalid(CACHE_KWARG, f"<DynamicCache of {cache.get_seq_length()} tokens, used before>", "be a new, "
                      "empty cache: the strategies decode from an empty one and leave the cache they are given in "
                      "their own working state (rows of finished prompts dropped), so it cannot carry a conversation "
                      "into the next call", f"pass a new DynamicCache per call, or no `{CACHE_KWARG}`, with the whole "
                      "conversation as the prompt")
    position_ids = model_kwargs.get("position_ids")
    if position_ids is not None:
        real = left_padded_valid(lengths, input_ids.shape[1], input_ids.device)
        expected = (real.long().cumsum(dim=1) - 1).clamp(min=0)                    # (N, P): 0, 1, ... per row
        if position_ids.shape != input_ids.shape or not bool(
                (position_ids.to(input_ids.device)[real] == expected[real]).all()):
            raise invalid("position_ids", "<custom positions>", "follow the attention mask (0, 1, ... from each row's "
                          "first real token): the block grid is counted from position 0",
                          "drop `position_ids`; positions are derived from `attention_mask`")


def check_generator(generator: Any, device: torch.device, batch_size: int = 1) -> None:
    """Raise unless `generator` is `None`, a `torch.Generator` on the model's device type, or a list / tuple of
    `batch_size` of them (one per row: per-row randomness, :mod:`hf_dllm_spec.maths.sampling`).

    Raises:
        ValueError: naming `generator` (the element's index for a list).
    """
    if generator is None:
        return
    per_row = isinstance(generator, (list, tuple))
    if per_row and len(generator) != batch_size:
        raise invalid("generator", f"<{type(generator).__name__} of {len(generator)} generators>",
                      f"hold one torch.Generator per row of the batch (batch size {batch_size})",
                      "pass generator=[torch.Generator(device=model.device).manual_seed(seed) for seed in "
                      "seeds] with one seed per prompt, or one torch.Generator for the whole batch")
    rule = "be a torch.Generator" if per_row else "be a torch.Generator, a list of one per row, or None"
    fix = ("make every element torch.Generator(device=model.device).manual_seed(seed)" if per_row
           else "pass generator=torch.Generator(device=model.device).manual_seed(seed)")
    named = [(f"generator[{i}]", g) for i, g in enumerate(generator)] if per_row else [("generator", generator)]
    for name, element in named:
        if not isinstance(element, torch.Generator):
            raise invalid(name, element, rule, fix)
        if torch.device(element.device).type != torch.device(device).type:
            raise invalid(name, f"<torch.Generator on {element.device}>", f"live on the model's device ({device})",
                          fix)


def _special_ids(patch, model, gc=None) -> dict[str, Any]:
    gc = gc if gc is not None else getattr(model, "generation_config", None)
    ids: dict[str, Any] = {"eos_token_id": sorted(patch.stop_token_ids(model, gc)) or None}
    for key in ("pad_token_id", "bos_token_id"):
        value = getattr(gc, key, None)
        ids[key] = value if value is not None else getattr(model.config, key, None)
    return ids


def check_model_pair(target, target_patch, drafter, drafter_patch, generation_config=None) -> None:
    """Before any forward: the drafter must share the target's vocabulary (size and special ids).

    The target's special ids are its own, compared with the drafter's own (a drafter of another tokenizer differs).
    An id the call sets (`generation_config`: an `eos_token_id`, `pad_token_id` or `bos_token_id` other than the
    target's own, such as the common `pad_token_id=tokenizer.eos_token_id`) is never compared: both models use it
    (the session's stop and pad ids), as stock `generate` and the other strategies accept it.

    Raises:
        ValueError: naming the first difference (vocabulary size, eos/pad/bos ids).
    """
    check_vocabulary(target, target_patch, drafter, drafter_patch)
    ids_call, ids_target = _special_ids(target_patch, target, generation_config), _special_ids(target_patch, target)
    ids_drafter = _special_ids(drafter_patch, drafter)
    for key, value in ids_target.items():
        other = ids_drafter[key]
        if ids_call[key] != value:          # set by the call: what both models use
            continue
        if value is not None and other is not None and value != other:
            raise invalid("draft_model", f"<{key}={other}>", f"use the target's {key} ({value})",
                          f"align the drafter's generation config (`draft_model.generation_config.{key} = {value}`)")


__all__ = ["DecodePlan", "build_plan", "check_attention_mask", "check_block_budget", "check_cache_implementation",
           "check_drafter_tokens", "check_generation_config", "check_generator", "check_inputs_embeds",
           "check_model_kinds",
           "check_model_kwargs", "check_model_pair", "check_row", "check_single_hypothesis", "check_streamer",
           "check_token_id", "check_vocabulary", "prompt_lengths"]
