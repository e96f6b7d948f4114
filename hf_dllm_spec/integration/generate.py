"""`generate` integration: the `custom_generate` callable that every entry point runs.

Three entry points, one code path:

- any transformers causal LM: ``model.generate(ids, custom_generate=hf_dllm_spec.custom_generate,
  decoding_strategy="s2d2", ...)``; transformers prepares the inputs, logits processors and stopping criteria,
  then calls :func:`dllm_generate`;
- model classes with :class:`~hf_dllm_spec.integration.mixin.DllmGenerationMixin` (e.g. SDAR):
  ``model.generate(ids, decoding_strategy="s2d2", ...)`` routes to the same callable;
- the Hub folder `custom_generate/generate.py` hands the call back to transformers' `generate` with it.

transformers does not pass `streamer` or `assistant_model` to a `custom_generate` callable (it puts the prompt
on the streamer and drops both). :func:`dllm_generate` reads them from the `generate` call that invoked it, so
a streamer receives the final tokens and `end()`, and `assistant_model` is an alias of `draft_model`. Called
directly, :func:`dllm_generate` hands itself to transformers' `generate`, so every entry point prepares
processors, stopping criteria and generation options the same way.

Strategy parameters are keyword arguments of :func:`dllm_generate` (its signature lists every parameter of
every registered strategy, so transformers routes them to it and still rejects typos); they merge with a stored
``generation_config.dllm_decoding``, an optional `preset` and an optional `strategy_config` object.
"""

from __future__ import annotations

import inspect
import os
import warnings
from typing import Any

import torch
from transformers import (EosTokenCriteria, GenerationConfig, GenerationMixin, LogitsProcessorList,
                          MaxLengthCriteria, StoppingCriteriaList, StopStringCriteria)

import model_patches
from model_patches.compat import find_cache

from .checks import (check_attention_mask, check_block_budget, check_call, check_drafter_tokens,
                     check_generation_config, check_generator, check_inputs_embeds, check_loaded,
                     check_mask_not_in_prompt, check_model_kwargs, check_token_id, check_tokens, check_vocabulary,
                     prompt_lengths)
from ..configuration import DecodingConfig, check_int
from ..outputs import BatchStats, GenerateDllmOutput
from ..strategies.registry import get_strategy, resolve_config, strategy_parameter_names
from ..runtime.placement import execution_device
from ..runtime.quantization import check_quantized_model
from ..runtime.runner import DRAFT_MODEL_SPAN
from ..runtime.static import drop_prepared_static_cache, hold_static_runtime, make_runner, static_cache_length
from ..maths.sampling import Sampler
from ..strategies import DecodingSession
from ..strategies.streaming import TokenStream
from ..runtime.timing import ForwardTimer, now
from ..validation import invalid

_UNSET: Any = type("Unset", (), {"__repr__": lambda self: "<unset>"})()

_GENERATE_CODE = inspect.unwrap(GenerationMixin.generate).__code__


def stop_strings_as_criteria(kwargs: dict[str, Any]) -> dict[str, Any]:
    """Turn `stop_strings=` (+ `tokenizer=`) into a `StopStringCriteria` in `stopping_criteria`.

    transformers drops `tokenizer` before calling a `custom_generate` callable and then cannot build the
    stop-string criterion itself; built here, it reaches the decoding loop like any other criterion. (On a plain
    transformers model's `custom_generate=` path, `stop_strings` is a parameter of the callable, which reads the
    tokenizer from the `generate` call: :func:`dllm_generate`.)

    Raises:
        ValueError: if `stop_strings` is given without `tokenizer`.
    """
    stop_strings = kwargs.pop("stop_strings", None)
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


def _generate_call_arguments(model) -> dict[str, Any]:
    """`streamer`, `assistant_model`, `tokenizer` and the raw `attention_mask` of the transformers `generate` call
    that invoked the callable, if any.

    transformers drops `streamer`, `assistant_model` and `tokenizer` for `custom_generate` callables, and derives
    `position_ids` from the mask as given before it drops an all-ones mask; they are read from its frame (the code
    object is checked, so another caller is never mistaken for it). `tokenizer` is popped inside `generate`: it is
    read from the decorators' frames right above it (`torch.no_grad`, transformers' `deprecate_kwarg`), which hold
    the call's keyword arguments as given.
    """
    frame = inspect.currentframe()
    try:
        caller = frame.f_back if frame is not None else None
        for _ in range(6):
            if caller is None:
                break
            if caller.f_code is _GENERATE_CODE and caller.f_locals.get("self") is model:
                found = {k: caller.f_locals.get(k) for k in ("streamer", "assistant_model")}
                raw = caller.f_locals.get("kwargs")
                found["attention_mask"] = raw.get("attention_mask") if isinstance(raw, dict) else None
                found["tokenizer"] = None
                wrapper = caller.f_back
                while wrapper is not None and found["tokenizer"] is None:
                    args, raw = wrapper.f_locals.get("args"), wrapper.f_locals.get("kwargs")
                    if not (isinstance(args, tuple) and args and args[0] is model and isinstance(raw, dict)):
                        break                                   # past the decorators of `generate`
                    found["tokenizer"] = raw.get("tokenizer")
                    wrapper = wrapper.f_back
                return found
            caller = caller.f_back
    finally:
        del frame
    return {}


def _caller_stacklevel() -> int:
    """`stacklevel` that points a warning at the first frame outside the library, transformers and torch."""
    internal = tuple(f"{os.sep}{name}{os.sep}"
                     for name in ("hf_dllm_spec", "model_patches", "transformers", "torch", "custom_generate"))
    frame, level = inspect.currentframe(), 1
    try:
        while frame is not None and (level == 1 or any(part in frame.f_code.co_filename for part in internal)):
            frame, level = frame.f_back, level + 1
    finally:
        del frame
    return level - 1


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
            f"model_type `{model.config.model_type}`: running off-distribution.", stacklevel=_caller_stacklevel(),
        )
    return resolved


def _special_ids(patch, model, gc=None) -> dict[str, Any]:
    gc = gc if gc is not None else getattr(model, "generation_config", None)
    ids: dict[str, Any] = {"eos_token_id": sorted(patch.stop_token_ids(model, gc)) or None}
    for key in ("pad_token_id", "bos_token_id"):
        value = getattr(gc, key, None)
        ids[key] = value if value is not None else getattr(model.config, key, None)
    return ids


def check_model_pair(target, target_patch, drafter, drafter_patch, generation_config=None) -> None:
    """Before any forward: the drafter must share the target's vocabulary (size and special ids).

    The target's special ids are those of this call (`generation_config`), the drafter's its own. A stop list the
    call sets (an `eos_token_id` other than the target's own) is never compared: it is what both models stop on
    (the session's stop ids), as stock `generate` and the other strategies accept it; without one, the target's
    own stop ids must match the drafter's (a drafter of another tokenizer).

    Raises:
        ValueError: naming the first difference (vocabulary size, eos/pad/bos ids).
    """
    check_vocabulary(target, target_patch, drafter, drafter_patch)
    ids_target = _special_ids(target_patch, target, generation_config)
    ids_drafter = _special_ids(drafter_patch, drafter)
    per_call_stops = ids_target["eos_token_id"] != _special_ids(target_patch, target)["eos_token_id"]
    for key, value in ids_target.items():
        other = ids_drafter[key]
        if key == "eos_token_id" and per_call_stops:
            continue
        if value is not None and other is not None and value != other:
            raise invalid("draft_model", f"<{key}={other}>", f"use the target's {key} ({value})",
                          f"align the drafter's generation config (`draft_model.generation_config.{key} = {value}`)")


def _stop_cut(ids: list[int], stop_ids: set[int]) -> int:
    """Length of `ids` up to and including the first stop id (kept, HF convention); all of them without one."""
    return next((k + 1 for k, token in enumerate(ids) if token in stop_ids), len(ids))


@torch.no_grad()
def dllm_generate(
    model,
    input_ids: torch.Tensor,
    logits_processor: LogitsProcessorList | None = None,
    stopping_criteria=None,
    generation_config: GenerationConfig | None = None,
    synced_gpus: bool = False,
    streamer=None,
    *,
    decoding_strategy: str,
    generator: torch.Generator | list[torch.Generator] | None = None,
    mask_token_id: int | None = None,
    strategy_config: DecodingConfig | None = None,
    preset: str | None = None,
    draft_model=None,
    assistant_model=None,
    draft_mask_token_id: int | None = None,
    stop_strings: str | list[str] | None = None,
    **kwargs: Any,
):
    """Decode with a hf_dllm_spec strategy; the `custom_generate` callable of transformers' `generate`.

    Args:
        model (`PreTrainedModel`): the target, a model of a family in `model_patches` (SDAR, Qwen2/3).
        input_ids (`torch.LongTensor` of shape `(N, P)`): the prompts, left-padded (`attention_mask` says where).
        logits_processor (`LogitsProcessorList`, *optional*): prepared by `generate`; only position-independent
            processors (temperature, top-k, top-p, min-p, typical, epsilon, eta, suppress tokens) are accepted.
        stopping_criteria (`StoppingCriteriaList`, *optional*): evaluated per row after each finished block on
            the final tokens.
        generation_config (`GenerationConfig`, *optional*): `max_new_tokens`, `do_sample`, `eos_token_id`,
            `pad_token_id`, `use_cache` (False recomputes every forward without a cache),
            `return_dict_in_generate`.
        streamer (`BaseStreamer`, *optional*): receives the prompt, final tokens as soon as they are final, then
            `end()` (batch size 1). Through `generate`, the streamer passed there (transformers drops it for
            callables; it is read from the call).
        decoding_strategy (`str`): a registered strategy: "ar", "block_diffusion", "s2d2", ...
        generator (`torch.Generator` or a list of them, *optional*): the only source of randomness; the same seed
            gives the same tokens. Without it torch's global RNG is used. A list (or tuple) holds one generator per
            row (length N, each on the model's device): every random draw of row i comes from generator i, so each
            row gets the tokens of its prompt decoded alone with that generator (`generator=[g]`), whatever the
            batch (per-request seeds). Per row, per step: the denoising step's token draw, then the row's
            verification (uniforms, then the recovered or bonus token); the full order is in
            :mod:`hf_dllm_spec.maths.sampling`.
        mask_token_id (`int`, *optional*): overrides the target's mask token.
        strategy_config (`DecodingConfig`, *optional*): a config object of the chosen strategy.
        preset (`str`, *optional*): a named configuration, e.g. "sdar-8b-config-a" for S2D2.
        draft_model (`PreTrainedModel`, *optional*): the drafter of strategies that use one (SimSD, DEER). It
            keeps its own device, dtype and `device_map` (accelerate offload): token ids go to its execution
            device and its block logits come back to the target's; caches never move (docs/placement.md).
        assistant_model (`PreTrainedModel`, *optional*): transformers' name for it; an alias of `draft_model`.
        draft_mask_token_id (`int`, *optional*): overrides the drafter's mask token.
        stop_strings (`str` or `list[str]`, *optional*): transformers' stop strings, with `tokenizer=` as for stock
            `generate`. A parameter of the callable, so transformers hands them over instead of refusing them: it
            drops `tokenizer` before calling a `custom_generate` callable (the tokenizer is read from the call).
        **kwargs: strategy parameters (see the config classes) and the model kwargs transformers prepared.

    Returns:
        `torch.LongTensor` of shape `(N, P + n)`: the prompts as given, then each row's new tokens (at most
        `max_new_tokens`, up to and including the first stop id), right-padded with `pad_token_id`; or
        `GenerateDllmOutput` with `spec_stats` and `spec_stats_per_row` when `return_dict_in_generate=True`.

    Raises:
        ValueError: unknown strategy, bad parameter, right padding, missing mask token, budget < 1, prompt
            beyond the model's positions, a streamer with batch > 1, a drafter where none is used (or none where
            one is needed), a drafter with another vocabulary; all before any forward.
        NotImplementedError: an unsupported model family or logits processor.
    """
    call = _generate_call_arguments(model)
    if stop_strings is not None:
        tokenizer = kwargs.pop("tokenizer", None)                          # a direct call keeps it
        tokenizer = tokenizer if tokenizer is not None else call.get("tokenizer")
        stopping_criteria = stop_strings_as_criteria(
            {"stop_strings": stop_strings, "tokenizer": tokenizer, "stopping_criteria": stopping_criteria})[
            "stopping_criteria"]
    if not call:
        check_call(model, (input_ids,), kwargs)
        # A direct call: hand it to transformers' `generate` with this callable, so the logits processors,
        # stopping criteria and generation options are prepared exactly as on the other entry points.
        return GenerationMixin.generate(
            model, input_ids, generation_config=generation_config, logits_processor=logits_processor,
            stopping_criteria=stopping_criteria, streamer=streamer, assistant_model=assistant_model,
            custom_generate=dllm_generate, decoding_strategy=decoding_strategy, generator=generator,
            mask_token_id=mask_token_id, strategy_config=strategy_config, preset=preset, draft_model=draft_model,
            draft_mask_token_id=draft_mask_token_id, **kwargs)
    streamer = streamer if streamer is not None else call.get("streamer")
    try:
        return _decode(model, input_ids, logits_processor, stopping_criteria, generation_config, kwargs,
                       streamer=streamer, decoding_strategy=decoding_strategy, generator=generator,
                       mask_token_id=mask_token_id, strategy_config=strategy_config, preset=preset,
                       draft_model=_draft_model(draft_model, assistant_model, call),
                       draft_mask_token_id=draft_mask_token_id, raw_attention_mask=call.get("attention_mask"))
    finally:
        if streamer is not None:        # always, also when a check or the decoding fails (no hung consumer)
            streamer.end()


def _draft_model(draft_model, assistant_model, call: dict[str, Any]):
    """`draft_model`, or transformers' `assistant_model` as its alias (also when transformers dropped it)."""
    assistant_model = assistant_model if assistant_model is not None else call.get("assistant_model")
    if assistant_model is None:
        return draft_model
    if draft_model is not None and draft_model is not assistant_model:
        raise invalid("assistant_model", type(assistant_model).__name__,
                      "not be given together with a different `draft_model`", "pass only `draft_model`")
    return assistant_model


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


class _CriteriaScan:
    """transformers' stopping criteria, called as transformers calls them: the whole batch in, one verdict per row.

    Stock `generate` calls its criteria once per generated position t on the batch `(N, P + t)` (the padded prompts,
    then every row's tokens, finished rows continued with `pad_token_id`) and a row ends at the first t where a
    criterion fires for it; criteria may keep per-row state across calls (lm-evaluation-harness's stop sequences do)
    or return one bool for the batch. A block decoder finishes several tokens at once and its rows advance at
    different paces, so position t is evaluated once every row's token t is final (or the row has ended): each row
    is then cut at the exact token where a criterion first fires for it, as in stock `generate`; a row that runs
    ahead of the batch may decode past its cut (the surplus is discarded).
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
        fired = self.criteria(torch.cat([self.input_ids, torch.stack(rows)], dim=1), None)
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


def _decode(model, input_ids, logits_processor, stopping_criteria, generation_config, kwargs, *, streamer,
            decoding_strategy, generator, mask_token_id, strategy_config, preset, draft_model,
            draft_mask_token_id, raw_attention_mask=None):
    """The body of :func:`dllm_generate`: checks, session, strategy, output (`raw_attention_mask`: the mask as
    the caller passed it to `generate`, before transformers derived positions from it and dropped it if all ones)."""
    generation_config = generation_config if generation_config is not None else model.generation_config
    names = set(strategy_parameter_names())
    overrides = {k: kwargs.pop(k) for k in list(kwargs) if k in names and kwargs[k] is not _UNSET}
    for k in [k for k in kwargs if kwargs[k] is _UNSET]:
        kwargs.pop(k)

    config = resolve_config(decoding_strategy, generation_config=generation_config,
                            strategy_config=strategy_config, preset=preset, overrides=overrides)
    strategy_cls = get_strategy(config.decoding_strategy)
    check_generation_config(generation_config)
    check_loaded(model, "model")
    if draft_model is not None:
        check_loaded(draft_model, "draft_model")
    check_token_id("mask_token_id", mask_token_id, "pass the mask token's integer id (e.g. `tokenizer.mask_token_id`)")
    check_token_id("draft_mask_token_id", draft_mask_token_id, "pass the drafter's mask token's integer id")
    check_inputs_embeds(kwargs.get("inputs_embeds"))
    check_attention_mask(input_ids, raw_attention_mask)
    lengths = prompt_lengths(input_ids, kwargs.get("attention_mask"))
    drop_prepared_static_cache(generation_config, kwargs)      # the one transformers made for "static": unused
    check_model_kwargs(input_ids, kwargs, lengths)
    device = execution_device(model)         # not `model.device`: "meta" under accelerate offload
    check_generator(generator, device, input_ids.shape[0])
    batch_size = input_ids.shape[0]
    if streamer is not None and batch_size > 1:
        raise invalid("streamer", type(streamer).__name__, "be used with batch size 1 (transformers' streamers "
                      f"follow one sequence; got {batch_size} rows)",
                      "decode one prompt at a time when streaming, or drop `streamer`")

    patch = model_patches.get_patch(model)
    drafter_patch = model_patches.get_patch(draft_model) if draft_model is not None else None
    strategy_cls.check_models(model, patch, draft_model, drafter_patch)
    check_quantized_model(model, "model")
    if draft_model is not None:
        check_quantized_model(draft_model, "draft_model")
    alignment = patch.alignment_of(model)
    resolved_mask = patch.mask_token_id(model, mask_token_id)
    needs_mask = strategy_cls.requires_mask_token and not (strategy_cls.name == "ar" and alignment == "right_shift")
    if needs_mask and resolved_mask is None:
        raise invalid("mask_token_id", None, f"be known for decoding_strategy={config.decoding_strategy!r}: "
                      f"model_type `{model.config.model_type}` has no `mask_token_id` in its config or generation "
                      "config", "pass mask_token_id=<id> to generate, or set config.mask_token_id")
    max_positions = patch.max_positions(model)
    block_size = _resolve_block_size(patch, model, getattr(config, "block_size", None))
    if max_positions is not None and block_size > max_positions:
        raise invalid("block_size", block_size, f"fit in the model's {max_positions} positions",
                      f"pass a block size <= {max_positions} (the checkpoint's trained size is "
                      f"{patch.trained_block_size(model)})")
    steps = getattr(config, "steps_per_block", None)
    if steps is not None and steps > block_size:
        implicit = " (the checkpoint's trained block size)" if getattr(config, "block_size", None) is None else ""
        raise invalid("steps_per_block", steps, f"be at most the block size {block_size}{implicit}",
                      "use steps_per_block <= block_size (one token per step at least)")
    max_new_tokens = _resolve_budget(input_ids, generation_config)
    needed = max(-(-(n + max_new_tokens) // block_size) * block_size for n in lengths)   # end of the last block
    if max_positions is not None and needed > max_positions:
        raise invalid("input_ids", f"<prompt of {max(lengths)} tokens>",
                      f"fit with max_new_tokens={max_new_tokens}, decoded in whole blocks of {block_size} "
                      f"(up to position {needed}), in the model's {max_positions} positions",
                      "shorten the prompt or lower max_new_tokens")
    if strategy_cls.decodes_whole_blocks:
        check_block_budget(block_size, patch.trained_block_size(model), lengths, max_new_tokens)
    stop_ids = patch.stop_token_ids(model, generation_config)
    pad_id = generation_config.pad_token_id if generation_config.pad_token_id is not None else (
        stop_ids[0] if stop_ids else None)
    if batch_size > 1 and pad_id is None:
        raise invalid("pad_token_id", None, "be set to right-pad rows that finish early in a batch",
                      "pass pad_token_id=<id> (transformers uses the eos id) or set generation_config.pad_token_id")
    check_tokens(input_ids, lengths, model.get_input_embeddings().num_embeddings, mask_token_id=resolved_mask,
                 stop_ids=stop_ids, pad_token_id=pad_id, mask_required=needs_mask)

    draft_mask = draft_block_size = None
    if draft_model is not None and not strategy_cls.uses_drafter:
        raise invalid("draft_model", type(draft_model).__name__,
                      f"be None for decoding_strategy={config.decoding_strategy!r}, which drafts with the target "
                      "itself", "drop `draft_model` / `assistant_model`, or pick a strategy that uses a drafter")
    if strategy_cls.uses_drafter:
        if draft_model is None:
            raise invalid("draft_model", None, f"be given for decoding_strategy={config.decoding_strategy!r}",
                          "pass draft_model=<a smaller model of the same tokenizer>")
        check_model_pair(model, patch, draft_model, drafter_patch, generation_config)
        draft_mask = drafter_patch.mask_token_id(draft_model, draft_mask_token_id)
        if strategy_cls.requires_draft_mask_token and draft_mask is None:
            raise invalid("draft_mask_token_id", None, f"be known for decoding_strategy={config.decoding_strategy!r}: "
                          f"the drafter (model_type `{draft_model.config.model_type}`) has no `mask_token_id`",
                          "pass draft_mask_token_id=<id>, or set draft_model.config.mask_token_id")
        check_drafter_tokens(draft_model.get_input_embeddings().num_embeddings, mask_token_id=draft_mask,
                             sep_token_id=getattr(config, "sep_token_id", None), stop_ids=stop_ids)
        draft_block_size = getattr(config, "draft_block_size", None) or drafter_patch.trained_block_size(draft_model)
        strategy_cls.check_block_sizes(block_size, draft_block_size)
        if draft_mask is not None:
            check_mask_not_in_prompt(input_ids, lengths, draft_mask, owner="drafter's")

    timer = ForwardTimer(device)
    stats = BatchStats(batch_size)
    use_cache = generation_config.use_cache is not False          # None (unset) means the default: cached
    prompts = [input_ids[n, input_ids.shape[1] - lengths[n]:].to(device) for n in range(batch_size)]
    stopping_criteria = criteria_to_scan(stopping_criteria, stop_ids, input_ids.shape[1], max_new_tokens)
    scan = _CriteriaScan(stopping_criteria, input_ids, pad_id, max_new_tokens) if stopping_criteria else None

    stop_set = set(stop_ids)

    def final_tokens(prompt_index: int, generated: torch.Tensor, ended: bool = False,
                     host_ids: list[int] | None = None) -> tuple[torch.Tensor, bool]:
        """What a row returns of its final tokens `(n,)` (the budget, the first stop id, the first criterion match;
        `ended`: the row decodes no more), and whether the row ends there. One host read of the tokens, none when
        the caller passes them as `host_ids`."""
        kept = generated[:max_new_tokens]
        ids = host_ids[:max_new_tokens] if host_ids is not None else kept.tolist()
        cut = _stop_cut(ids, stop_set)
        tokens = kept[:cut]
        ended = (ended or cut < generated.shape[0] or cut >= max_new_tokens
                 or (cut > 0 and ids[cut - 1] in stop_set))
        if scan is not None:
            criteria_cut = scan.observe(prompt_index, tokens, ended=ended)
            if criteria_cut is not None:
                return tokens[:criteria_cut], True
        return tokens, ended

    def output_tokens(prompt_index: int, generated: torch.Tensor, ended: bool = False) -> torch.Tensor:
        return final_tokens(prompt_index, generated, ended)[0]

    suppress = [resolved_mask] if resolved_mask is not None else []
    cache_len = static_cache_length(input_ids.shape[1], max_new_tokens, max(block_size, draft_block_size or 0))
    with hold_static_runtime(generation_config, model, draft_model):     # one static call per model at a time
        session = DecodingSession(
            prompts=prompts,
            target=make_runner(model, patch, stats, batch_size=batch_size, use_cache=use_cache, timer=timer,
                               cache=find_cache(kwargs) if use_cache else None, generation_config=generation_config,
                               max_cache_len=cache_len),
            sampler=Sampler(logits_processor if logits_processor is not None else LogitsProcessorList(),
                            do_sample=bool(generation_config.do_sample), suppress_token_ids=suppress,
                            generator=generator),
            stats=stats, mask_token_id=resolved_mask if resolved_mask is not None else 0, stop_token_ids=stop_ids,
            max_new_tokens=max_new_tokens, block_size=block_size,
            stop_check=lambda i, generated, host_ids: final_tokens(i, generated, host_ids=host_ids)[1],
            drafter=make_runner(draft_model, drafter_patch, stats, batch_size=batch_size, use_cache=use_cache,
                                timer=timer, timer_span=DRAFT_MODEL_SPAN, generation_config=generation_config,
                                max_cache_len=cache_len) if draft_model is not None else None,
            draft_mask_token_id=draft_mask, draft_block_size=draft_block_size,
            stream=TokenStream(streamer, lambda final: output_tokens(0, final)) if streamer is not None else None,
        )
        strategy = strategy_cls(config, session)
        t0 = now(device)
        generated = strategy.decode()
    wall = now(device) - t0
    forward_time, prefill_time = timer.total("forward"), timer.total("prefill")
    draft_model_time, warmup_time = timer.total(DRAFT_MODEL_SPAN), timer.total("warmup")
    runtime = "; ".join(f"{role}: {runner.runtime_note}"
                        for role, runner in (("target", session.target), ("drafter", session.drafter)) if runner)
    if scan is not None:                       # every row has ended: the criteria see every position
        for n, g in enumerate(generated):
            output_tokens(n, g, ended=True)
    generated = [output_tokens(n, g, ended=True) for n, g in enumerate(generated)]
    stats.flush()
    for n, row in enumerate(stats.per_row):
        row.num_generated_tokens = generated[n].shape[0]
        row.num_discarded_tokens = row.num_committed_tokens - row.num_generated_tokens
        row.wall_time_s, row.forward_time_s, row.prefill_time_s = wall, forward_time, prefill_time
        row.draft_model_time_s, row.warmup_time_s, row.runtime = draft_model_time, warmup_time, runtime
    width = max(g.shape[0] for g in generated)
    new = torch.full((batch_size, width), pad_id if pad_id is not None else 0, dtype=torch.long, device=device)
    for n, g in enumerate(generated):
        new[n, : g.shape[0]] = g
    sequences = torch.cat([input_ids.to(device), new], dim=1)
    if generation_config.return_dict_in_generate:
        return GenerateDllmOutput(sequences=sequences, spec_stats=stats.total(), spec_stats_per_row=stats.per_row)
    return sequences




_BASE_SIGNATURE = inspect.signature(dllm_generate)


def refresh_signature() -> None:
    """Expose every registered strategy parameter as a keyword-only argument of :func:`dllm_generate`, so
    transformers routes it to the callable (and still rejects typos)."""
    params = [p for p in _BASE_SIGNATURE.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
    taken = {p.name for p in params}
    params += [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=_UNSET)
               for name in strategy_parameter_names() if name not in taken]
    params.append(inspect.Parameter("kwargs", inspect.Parameter.VAR_KEYWORD))
    dllm_generate.__signature__ = _BASE_SIGNATURE.replace(parameters=params)


refresh_signature()
