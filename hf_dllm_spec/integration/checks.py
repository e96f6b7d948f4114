"""The checks of the raw `generate(*args, **kwargs)` call, before transformers prepares anything.

transformers itself fails on some bad arguments with unrelated errors (a Python list of ids, a string budget), so
:func:`check_call` refuses them first, on every entry point that sees the raw call (the model classes' `generate`,
a direct call of the `custom_generate` callable). Everything else is checked once, inside the callable, while the
call's plan is built (:mod:`hf_dllm_spec.integration.plan`, whose checks this module reuses). Every error uses the
library's format (`hf_dllm_spec.validation.invalid`): the argument, its value, the rule and the fix.
"""

from __future__ import annotations

from typing import Any

import torch

from ..runtime.weights import check_weights
from ..validation import check_int, invalid
from .plan import (SINGLE_HYPOTHESIS, check_attention_mask, check_cache_implementation, check_inputs_embeds,
                   check_single_hypothesis, check_streamer)


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
        ValueError: the model, `draft_model` or `assistant_model` with weights that cannot decode
            (:func:`hf_dllm_spec.runtime.weights.check_weights`: on the meta device, never loaded; an
            accelerate-offloaded model runs on its execution device and passes; a refused quantization); a tensor
            argument on the meta device; `inputs_embeds`; `input_ids` not a 2D integer tensor `(N, P)`; an
            `attention_mask` that is not a 0/1 tensor of the shape of `input_ids`
            (:func:`~hf_dllm_spec.integration.plan.check_attention_mask`); `max_new_tokens` / `max_length` not an
            integer >= 1, a `max_length` that leaves no new token; `num_beams` / `num_return_sequences` /
            `num_beam_groups` other than 1; a `cache_implementation` the strategies cannot decode over or a
            `max_cache_len` that is not an integer >= 1
            (:func:`~hf_dllm_spec.integration.plan.check_cache_implementation`); a `streamer` without `put` and `end`
            (:func:`~hf_dllm_spec.integration.plan.check_streamer`).
    """
    check_weights(model, "model")
    for name in ("draft_model", "assistant_model"):
        if kwargs.get(name) is not None:
            check_weights(kwargs[name], name)
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
    for name in SINGLE_HYPOTHESIS:                  # transformers refuses some of them first, in its own words
        check_single_hypothesis(name, kwargs.get(name))
    check_streamer(kwargs.get("streamer"))          # transformers sends it the prompt before the callable runs
    # transformers builds the cache it names before the callable runs ("offloaded" makes a device stream)
    config = kwargs.get("generation_config") or getattr(model, "generation_config", None)
    check_cache_implementation(kwargs.get("cache_implementation", getattr(config, "cache_implementation", None)),
                               kwargs.get("max_cache_len", getattr(config, "max_cache_len", None)))


__all__ = ["check_call"]
