"""The plan of one `generate` call: every fact the decoding needs, resolved and checked once, before any forward.

:func:`build_plan` takes the model(s), the call's arguments and the generation config and returns a frozen
:class:`DecodePlan`: the strategy and its validated config (block size filled in), the mask, stop and pad ids, the
budget, the prompts' lengths, the drafter and its block size, the runtime (eager or static), the sampling mode and
generator, the stopping criteria left to scan. Every check of bad input runs while it is built (each names the
argument, its value, the rule and the fix); nothing after it validates. Strategies read the plan's values through
their config and the session :func:`~hf_dllm_spec.integration.generate.dllm_generate` builds from it.

Source: issue 33 ("A plan per call").
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass
from typing import Any

import torch
from transformers import GenerationConfig

import model_patches

from ..configuration import DecodingConfig, check_int
from ..runtime.placement import execution_device
from ..runtime.quantization import check_quantized_model
from ..runtime.static import drop_prepared_static_cache, static_cache_length
from ..strategies.base import DecodingStrategy
from ..strategies.registry import get_strategy, resolve_config
from ..validation import invalid
from ..bridge import caller_stacklevel
from .checks import (check_attention_mask, check_block_budget, check_drafter_tokens, check_generation_config,
                     check_generator, check_inputs_embeds, check_loaded, check_mask_not_in_prompt,
                     check_model_kwargs, check_model_pair, check_token_id, check_tokens, prompt_lengths)
from .stopping import criteria_to_scan


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
        suppress_ids (`tuple[int, ...]`): token ids never sampled (the target's mask token).
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

    @property
    def batch_size(self) -> int:
        return len(self.lengths)


def build_plan(model, input_ids: torch.Tensor, generation_config: GenerationConfig, model_kwargs: dict[str, Any], *,
               decoding_strategy: str, overrides: dict[str, Any], strategy_config: DecodingConfig | None,
               preset: str | None, draft_model, mask_token_id: int | None, draft_mask_token_id: int | None,
               generator, streamer, stopping_criteria, raw_attention_mask=None) -> DecodePlan:
    """Resolve and check one call (see the module docstring); `model_kwargs` loses the static cache transformers
    prepared for `cache_implementation="static"` (the static runtime keeps its own).

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
    _check_call(model, input_ids, generation_config, model_kwargs, draft_model=draft_model,
                mask_token_id=mask_token_id, draft_mask_token_id=draft_mask_token_id, streamer=streamer,
                raw_attention_mask=raw_attention_mask)
    lengths = prompt_lengths(input_ids, model_kwargs.get("attention_mask"))
    drop_prepared_static_cache(generation_config, model_kwargs)
    check_model_kwargs(input_ids, model_kwargs, lengths)
    device = execution_device(model)                   # not `model.device`: "meta" under accelerate offload
    check_generator(generator, device, input_ids.shape[0])
    do_sample = bool(generation_config.do_sample)
    _check_acceptance(config, do_sample, generator)

    patch = model_patches.get_patch(model)
    drafter_patch = model_patches.get_patch(draft_model) if draft_model is not None else None
    strategy.check_models(model, patch, draft_model, drafter_patch)
    check_quantized_model(model, "model")
    if draft_model is not None:
        check_quantized_model(draft_model, "draft_model")
    block_size = _resolve_block_size(patch, model, getattr(config, "block_size", None))
    if "block_size" in {f.name for f in dataclasses.fields(config)} and config.block_size != block_size:
        config = dataclasses.replace(config, block_size=block_size)      # validates against the block size
    max_new_tokens = _resolve_budget(input_ids, generation_config)
    _check_positions(patch, model, lengths, block_size, max_new_tokens)
    if strategy.decodes_whole_blocks:
        check_block_budget(block_size, patch.trained_block_size(model), lengths, max_new_tokens)
    mask, stop_ids, pad_id = _resolve_tokens(strategy, config, patch, model, input_ids, lengths, generation_config,
                                             mask_token_id)
    draft_mask, draft_block_size = _resolve_drafter(strategy, config, model, patch, draft_model, drafter_patch,
                                                    input_ids, lengths, generation_config, stop_ids, block_size,
                                                    draft_mask_token_id)
    return DecodePlan(
        strategy=strategy, config=config, model=model, patch=patch, draft_model=draft_model,
        drafter_patch=drafter_patch, generation_config=generation_config, device=device, lengths=tuple(lengths),
        block_size=block_size, draft_block_size=draft_block_size, mask_token_id=mask, draft_mask_token_id=draft_mask,
        stop_ids=tuple(stop_ids), pad_id=pad_id, max_new_tokens=max_new_tokens,
        use_cache=generation_config.use_cache is not False,          # None (unset) means the default: cached
        static=generation_config.cache_implementation == "static",
        cache_len=static_cache_length(input_ids.shape[1], max_new_tokens, max(block_size, draft_block_size or 0)),
        do_sample=do_sample, generator=generator,
        criteria=criteria_to_scan(stopping_criteria, stop_ids, input_ids.shape[1], max_new_tokens),
        suppress_ids=(mask,) if mask is not None else ())


def _check_call(model, input_ids, generation_config, model_kwargs, *, draft_model, mask_token_id,
                draft_mask_token_id, streamer, raw_attention_mask) -> None:
    """The checks that need nothing resolved: options, loaded models, token ids, inputs, streamer."""
    check_generation_config(generation_config)
    check_loaded(model, "model")
    if draft_model is not None:
        check_loaded(draft_model, "draft_model")
    check_token_id("mask_token_id", mask_token_id, "pass the mask token's integer id (e.g. `tokenizer.mask_token_id`)")
    check_token_id("draft_mask_token_id", draft_mask_token_id, "pass the drafter's mask token's integer id")
    check_inputs_embeds(model_kwargs.get("inputs_embeds"))
    check_attention_mask(input_ids, raw_attention_mask)
    if streamer is not None and input_ids.shape[0] > 1:
        raise invalid("streamer", type(streamer).__name__, "be used with batch size 1 (transformers' streamers "
                      f"follow one sequence; got {input_ids.shape[0]} rows)",
                      "decode one prompt at a time when streaming, or drop `streamer`")


def _check_acceptance(config: DecodingConfig, do_sample: bool, generator) -> None:
    """Greedy means greedy: a random acceptance rule (rejection sampling of the drafts) under `do_sample=False`
    only with an explicit `generator` (the reference codes' random acceptance of argmax drafts, reproducible)."""
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


def _check_positions(patch, model, lengths: list[int], block_size: int, max_new_tokens: int) -> None:
    """Every row's prompt and budget, decoded in whole blocks, within the model's positions."""
    max_positions = patch.max_positions(model)
    needed = max(-(-(n + max_new_tokens) // block_size) * block_size for n in lengths)   # end of the last block
    if max_positions is not None and needed > max_positions:
        raise invalid("input_ids", f"<prompt of {max(lengths)} tokens>",
                      f"fit with max_new_tokens={max_new_tokens}, decoded in whole blocks of {block_size} "
                      f"(up to position {needed}), in the model's {max_positions} positions",
                      "shorten the prompt or lower max_new_tokens")


def _resolve_tokens(strategy, config, patch, model, input_ids, lengths, generation_config, mask_token_id):
    """`(mask id or None, stop ids, pad id or None)` of the target, checked against the prompts."""
    mask = patch.mask_token_id(model, mask_token_id)
    needs_mask = _needs_mask(strategy, patch, model)
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
    check_tokens(input_ids, lengths, model.get_input_embeddings().num_embeddings, mask_token_id=mask,
                 stop_ids=stop_ids, pad_token_id=pad_id, mask_required=needs_mask)
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
    if draft_mask is not None:
        check_mask_not_in_prompt(input_ids, lengths, draft_mask, owner="drafter's")
    return draft_mask, draft_block_size


def check_row(plan: DecodePlan, prompt_ids: torch.Tensor, max_new_tokens: int) -> None:
    """The checks of one more row of a planned call (a request that joins a running batch, continuous batching):
    its token ids, its prompt and budget within the model's positions, the block size against it.

    Args:
        prompt_ids (`torch.Tensor` of shape `(P,)`, int64): the row's prompt. max_new_tokens (`int`): its budget.

    Raises:
        ValueError: as :func:`build_plan` for the same row.
    """
    length = [prompt_ids.shape[0]]
    check_tokens(prompt_ids[None], length, plan.model.get_input_embeddings().num_embeddings,
                 mask_token_id=plan.mask_token_id, stop_ids=list(plan.stop_ids), pad_token_id=plan.pad_id,
                 mask_required=_needs_mask(plan.strategy, plan.patch, plan.model))
    if plan.draft_mask_token_id is not None:
        check_mask_not_in_prompt(prompt_ids[None], length, plan.draft_mask_token_id, owner="drafter's")
    _check_positions(plan.patch, plan.model, length, plan.block_size, max_new_tokens)
    if plan.strategy.decodes_whole_blocks:
        check_block_budget(plan.block_size, plan.patch.trained_block_size(plan.model), length, max_new_tokens)


__all__ = ["DecodePlan", "build_plan", "check_row"]
