"""Input checks of `generate` with a hf_dllm_spec strategy: everything is refused before the first forward.

Two stages. :func:`check_call` runs on the raw arguments before transformers prepares anything (transformers
itself fails on some of them with unrelated errors: a Python list of ids, a string budget); the rest run inside
the `custom_generate` callable on the prepared `GenerationConfig` and model kwargs. Every error uses the
library's format (`hf_dllm_spec.validation.invalid`): the argument, its value, the rule and the fix.
"""

from __future__ import annotations

import math
import operator
from typing import Any

import torch
from transformers import DynamicCache, GenerationConfig

from model_patches.compat import CACHE_KWARG, CACHE_NAMES, find_cache

from ..configuration import check_int
from ..maths.masks import left_padded_valid
from ..runtime.placement import execution_device
from ..runtime.quantization import check_quantized_model
from ..validation import invalid

#: Float options of `GenerationConfig` the sampler reads; NaN or infinity is refused.
FLOAT_GENERATION_OPTIONS = ("temperature", "top_p", "min_p", "typical_p", "epsilon_cutoff", "eta_cutoff",
                            "repetition_penalty")

#: Generation options that need one output per prompt and greedy or sampled decoding of one hypothesis.
_SINGLE_HYPOTHESIS = ("num_beams", "num_return_sequences", "num_beam_groups")

#: Model kwargs transformers prepares that the decoding loop reads or may ignore (it builds its own masks); the
#: cache under the name of every supported transformers version (`model_patches.compat.CACHE_NAMES`).
KNOWN_MODEL_KWARGS = {"attention_mask", "position_ids", "use_cache", "logits_to_keep", "cache_position",
                      *CACHE_NAMES}


def _input_ids_of(args: tuple, kwargs: dict[str, Any]) -> Any:
    if args:
        return args[0]
    for key in ("inputs", "input_ids"):
        if kwargs.get(key) is not None:
            return kwargs[key]
    return None


def check_call(model, args: tuple, kwargs: dict[str, Any]) -> None:
    """Checks on the raw `generate(*args, **kwargs)` call, before transformers prepares the inputs.

    Args:
        model (`PreTrainedModel`): the target.
        args (`tuple`): positional arguments of `generate` (the prompt first).
        kwargs (`dict`): keyword arguments of `generate`.

    Raises:
        ValueError: the model, `draft_model` or `assistant_model` on the meta device (weights never loaded; an
            accelerate-offloaded model runs on its execution device and passes); a quantized transformers assistant
            model that cannot decode (:func:`hf_dllm_spec.runtime.quantization.check_quantized_model`; the target and
            `draft_model` are checked where decoding starts, every entry point included); a tensor argument on the
            meta device; `inputs_embeds`; `input_ids` not a 2D integer tensor `(N, P)`; an `attention_mask` that is
            not a 0/1 tensor of the shape of `input_ids` (:func:`check_attention_mask`); `max_new_tokens` /
            `max_length` not an integer >= 1, a `max_length` that leaves no new token; `num_beams` /
            `num_return_sequences` / `num_beam_groups` other than 1.
    """
    check_loaded(model, "model")
    for name in ("draft_model", "assistant_model"):
        if isinstance(kwargs.get(name), torch.nn.Module):
            check_loaded(kwargs[name], name)
    if kwargs.get("assistant_model") is not None:
        check_quantized_model(kwargs["assistant_model"], "assistant_model")
    ids = _input_ids_of(args, kwargs)
    named = [("input_ids", ids)] if args else []
    for name, value in [*named, *kwargs.items()]:
        if isinstance(value, torch.Tensor) and value.device.type == "meta":
            raise invalid(name, f"<tensor of shape {tuple(value.shape)} on the meta device>", "hold real values",
                          "create it on the CPU or on the model's device")
    check_inputs_embeds(kwargs.get("inputs_embeds"))
    if ids is not None:
        if not isinstance(ids, torch.Tensor):
            raise invalid("input_ids", f"<{type(ids).__name__}>", "be a torch.LongTensor of shape (batch_size, "
                          "prompt_len)", "pass `torch.tensor([ids])` or the tokenizer's `return_tensors='pt'` output")
        if ids.dim() != 2:
            raise invalid("input_ids", f"<tensor of shape {tuple(ids.shape)}>", "have shape (batch_size, prompt_len)",
                          "add a batch dimension with `ids[None]`" if ids.dim() == 1 else "pass a 2D tensor")
        if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
            raise invalid("input_ids", f"<tensor of dtype {ids.dtype}>", "hold integer token ids",
                          "pass the tokenizer's ids (torch.long)")
        check_attention_mask(ids, kwargs.get("attention_mask"))
    for name in ("max_new_tokens", "max_length"):
        if kwargs.get(name) is not None:
            check_int(name, kwargs[name], 1, f"pass e.g. {name}=64")
    if (kwargs.get("max_new_tokens") is None and kwargs.get("max_length") is not None
            and isinstance(ids, torch.Tensor) and kwargs["max_length"] <= ids.shape[1]):
        raise invalid("max_length", kwargs["max_length"], f"exceed the prompt length ({ids.shape[1]}): it counts "
                      "the prompt and the new tokens", "pass max_new_tokens (the new tokens only) instead")
    for name in _SINGLE_HYPOTHESIS:                  # transformers refuses some of them first, in its own words
        _check_single_hypothesis(name, kwargs.get(name))


def check_loaded(model, name: str) -> None:
    """Raise unless `model` holds real weights: refused on the meta device (never loaded); a model that accelerate
    dispatched with offload runs on its execution device and passes.

    Raises:
        ValueError: naming `name` ("model", "draft_model", "assistant_model").
    """
    if execution_device(model).type == "meta":
        raise invalid(name, f"<{type(model).__name__} on the meta device>", "hold real weights to decode",
                      "load it with `from_pretrained` (or `to_empty` and load a state dict) before calling generate")


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


def _check_single_hypothesis(name: str, value: Any) -> None:
    if value is not None and value != 1:
        raise invalid(name, value, "be 1 for hf_dllm_spec strategies (one hypothesis per prompt)",
                      f"drop `{name}`; to draw several samples, repeat the prompt in the batch with "
                      "`do_sample=True`" if name == "num_return_sequences" else f"drop `{name}`")


def check_generation_config(generation_config: GenerationConfig) -> None:
    """Generation options the strategies do not support, and non-finite float options.

    Raises:
        ValueError: `num_beams`/`num_return_sequences` > 1, `output_scores`-like flags, NaN or infinite
            `temperature`, `top_p`, `min_p`, ... ; a `cache_implementation` other than unset, "dynamic" or "static";
            "static" with `use_cache=False`.
    """
    for name in _SINGLE_HYPOTHESIS:
        _check_single_hypothesis(name, getattr(generation_config, name, None))
    for flag in ("output_scores", "output_logits", "output_attentions", "output_hidden_states"):
        if getattr(generation_config, flag, False):
            raise invalid(flag, True, "be False for hf_dllm_spec strategies (per-token scores are not defined "
                          "for out-of-order commits)", f"drop `{flag}`; `return_dict_in_generate=True` "
                          "returns the statistics")
    for name in FLOAT_GENERATION_OPTIONS:
        value = getattr(generation_config, name, None)
        if isinstance(value, float) and not math.isfinite(value):
            raise invalid(name, value, "be a finite number", f"pass a finite `{name}` or drop it")
    if generation_config.cache_implementation not in (None, "dynamic", "static"):
        raise invalid("cache_implementation", generation_config.cache_implementation,
                      "be unset, 'dynamic' (the eager runtime over a DynamicCache) or 'static' (the static runtime: "
                      "a preallocated cache, CUDA graphs on GPU) for hf_dllm_spec strategies",
                      "drop `cache_implementation`, or pass cache_implementation='static'")
    if generation_config.cache_implementation == "static" and generation_config.use_cache is False:
        raise invalid("use_cache", False, "be True with cache_implementation='static' (the static runtime decodes "
                      "over its preallocated cache)", "drop `use_cache=False`, or drop `cache_implementation`")


def check_model_kwargs(input_ids: torch.Tensor, model_kwargs: dict[str, Any], lengths: list[int]) -> None:
    """Model kwargs transformers prepared: only a mask, consistent positions and an empty dynamic cache.

    Raises:
        ValueError: unknown model kwargs, `position_ids` that do not follow the attention mask, a cache (under the
            name of any supported transformers version, :data:`model_patches.compat.CACHE_NAMES`) that is not a
            `DynamicCache`, or two caches under both names.
    """
    unknown = sorted(set(model_kwargs) - KNOWN_MODEL_KWARGS)
    if unknown:
        raise invalid("model_kwargs", unknown, "be empty for hf_dllm_spec strategies",
                      "drop these arguments (the decoding loop builds its own inputs)")
    cache = find_cache(model_kwargs)
    if cache is not None and type(cache) is not DynamicCache:
        raise invalid(CACHE_KWARG, type(cache).__name__, "be an empty DynamicCache (or unset): the decoding "
                      "loop stores, reads and crops blocks", f"drop `cache_implementation` / `{CACHE_KWARG}`")
    position_ids = model_kwargs.get("position_ids")
    if position_ids is not None:
        real = left_padded_valid(lengths, input_ids.shape[1], input_ids.device)
        expected = (real.long().cumsum(dim=1) - 1).clamp(min=0)                    # (N, P): 0, 1, ... per row
        if position_ids.shape != input_ids.shape or not bool(
                (position_ids.to(input_ids.device)[real] == expected[real]).all()):
            raise invalid("position_ids", "<custom positions>", "follow the attention mask (0, 1, ... from each row's "
                          "first real token): the block grid is counted from position 0",
                          "drop `position_ids`; positions are derived from `attention_mask`")


def check_tokens(input_ids: torch.Tensor, lengths: list[int], vocab_size: int, *, mask_token_id: int | None,
                 stop_ids: list[int], pad_token_id: int | None, mask_required: bool) -> None:
    """Token ids against the vocabulary, and the mask token against the prompt and the stop ids.

    Args:
        input_ids (`torch.LongTensor` of shape `(N, P)`), lengths (`list[int]`): the left-padded prompts.
        vocab_size (`int`): rows of the model's input embedding.
        mask_token_id, stop_ids, pad_token_id: the resolved special ids.
        mask_required (`bool`): the strategy denoises with the mask token.

    Raises:
        ValueError: an id outside `[0, vocab_size)` in the prompt or among the special ids; the mask token in a
            prompt or among the stop ids.
    """
    tokens = input_ids[left_padded_valid(lengths, input_ids.shape[1], input_ids.device)]
    low, high = int(tokens.min()), int(tokens.max())
    if low < 0 or high >= vocab_size:
        raise invalid("input_ids", f"<ids from {low} to {high}>", f"lie in [0, {vocab_size}) (the model's vocabulary)",
                      "tokenize with the model's own tokenizer")
    for name, ids in (("mask_token_id", [mask_token_id] if mask_token_id is not None else []),
                      ("eos_token_id", stop_ids), ("pad_token_id", [pad_token_id] if pad_token_id is not None else [])):
        bad = [i for i in ids if not 0 <= i < vocab_size]
        if bad:
            raise invalid(name, bad[0] if len(ids) == 1 else ids, f"lie in [0, {vocab_size}) (the model's vocabulary)",
                          "pass the id the model's tokenizer uses")
    if mask_required and mask_token_id is not None:
        if mask_token_id in stop_ids:
            raise invalid("mask_token_id", mask_token_id, f"differ from the stop ids {stop_ids}",
                          "pass the model's mask token, not its end-of-sequence token")
        check_mask_not_in_prompt(input_ids, lengths, mask_token_id)


def check_mask_not_in_prompt(input_ids: torch.Tensor, lengths: list[int], mask_token_id: int,
                             owner: str = "") -> None:
    """Raise if a prompt (padding excluded) holds `mask_token_id`; `owner` names whose mask it is ("drafter's").

    Raises:
        ValueError: naming `input_ids` (infilling a prompt is not supported: the prompt is returned as given).
    """
    tokens = input_ids[left_padded_valid(lengths, input_ids.shape[1], input_ids.device)]
    if bool((tokens == mask_token_id).any()):
        whose = f"{owner} " if owner else ""
        raise invalid("input_ids", f"<prompt holding the {whose}mask token {mask_token_id}>",
                      f"not contain the {whose}mask token (infilling a prompt is not supported: the prompt is "
                      "returned as given)", "remove the mask tokens from the prompt")


def check_generator(generator: Any, device: torch.device, batch_size: int = 1) -> None:
    """Raise unless `generator` is `None`, a `torch.Generator` on the model's device type, or a list / tuple of
    `batch_size` of them (one per row: per-row randomness, :mod:`hf_dllm_spec.maths.sampling`).

    Raises:
        ValueError: naming `generator` (the element's index for a list).
    """
    if generator is None:
        return
    if isinstance(generator, (list, tuple)):
        if len(generator) != batch_size:
            raise invalid("generator", f"<{type(generator).__name__} of {len(generator)} generators>",
                          f"hold one torch.Generator per row of the batch (batch size {batch_size})",
                          "pass generator=[torch.Generator(device=model.device).manual_seed(seed) for seed in "
                          "seeds] with one seed per prompt, or one torch.Generator for the whole batch")
        for i, element in enumerate(generator):
            _check_one_generator(f"generator[{i}]", element, device)
        return
    _check_one_generator("generator", generator, device)


def _check_one_generator(name: str, generator: Any, device: torch.device) -> None:
    """`generator`, or the element `name` = "generator[i]" of a per-row list."""
    element = name != "generator"
    rule = "be a torch.Generator" if element else "be a torch.Generator, a list of one per row, or None"
    fix = ("make every element torch.Generator(device=model.device).manual_seed(seed)" if element
           else "pass generator=torch.Generator(device=model.device).manual_seed(seed)")
    if not isinstance(generator, torch.Generator):
        raise invalid(name, generator, rule, fix)
    if torch.device(generator.device).type != torch.device(device).type:
        raise invalid(name, f"<torch.Generator on {generator.device}>", f"live on the model's device ({device})", fix)


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
