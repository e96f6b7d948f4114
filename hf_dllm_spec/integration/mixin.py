"""`generate(decoding_strategy=...)` for model classes: a thin layer over the `custom_generate` callable.

:func:`generate_with_strategy` is the decoding backend of the families' model classes: their
:class:`~model_patches.generation.DllmGenerationMixin` (re-exported here) finds it through the entry point
group ``model_patches.decoding_backends`` that this distribution declares in `pyproject.toml`, so the family
package never imports the library (the dependency points one way: `hf_dllm_spec` -> `model_patches`).
"""

from __future__ import annotations

from typing import Any

from transformers import GenerationMixin

from model_patches.generation import DllmGenerationMixin

from .candidate_generator import draft_as_assistant, is_assistant_call
from .checks import check_call
from .generate import check_strategy_name, dllm_generate, ending_streamer, stop_strings_as_criteria


def heal_tokens_first(model, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
    """Run transformers' token healing on the prompt before decoding, when `token_healing=True`.

    transformers drops `tokenizer` before calling a `custom_generate` callable and then cannot heal; here
    `model.heal_tokens(input_ids, tokenizer)` runs first (its one-token regeneration is itself a `generate` call
    of this model, with a single-token sequence bias) and the healed prompt is decoded with healing off.

    Raises:
        ValueError: if `token_healing=True` comes without `tokenizer`.
    """
    config = kwargs.get("generation_config") or model.generation_config
    if not kwargs.pop("token_healing", None) and not getattr(config, "token_healing", False):
        return args, kwargs
    tokenizer = kwargs.get("tokenizer")
    if tokenizer is None:
        raise ValueError("`tokenizer` (=None) must be given with `token_healing=True`; pass "
                         "tokenizer=<the model's tokenizer> to generate.")
    if args:
        ids, args = args[0], args[1:]
    else:
        ids = kwargs.pop("inputs", None)
        ids = ids if ids is not None else kwargs.pop("input_ids")
    healed = model.heal_tokens(ids, tokenizer)
    kwargs["token_healing"] = False
    if tokenizer.pad_token_id is not None:
        kwargs["attention_mask"] = (healed != tokenizer.pad_token_id).long()
    else:
        kwargs.pop("attention_mask", None)
    return (healed, *args), kwargs


def generate_with_strategy(model, args: tuple, kwargs: dict[str, Any], decoding_strategy: str):
    """transformers' `generate` of `model` with hf_dllm_spec's callable (unless `kwargs` names another
    `custom_generate`): the one path of the model classes and of the Hub `custom_generate/` folder.

    Checks the raw call first (:func:`hf_dllm_spec.integration.checks.check_call`), heals the prompt when asked
    (:func:`heal_tokens_first`) and turns `stop_strings` into a criterion (:func:`stop_strings_as_criteria`),
    the two things transformers cannot do for a `custom_generate` callable.

    Raises:
        ValueError: for an unknown strategy, `input_ids` that are not a 2D integer tensor, a budget that is not
            an integer, a model on the meta device (all before transformers prepares the inputs).
    """
    with ending_streamer(kwargs.get("streamer")):      # a failure before the callable runs ends the stream too
        # unknown names fail here, before input preparation
        check_strategy_name(decoding_strategy, kwargs.get("generation_config"), model.generation_config)
        # a stock target's assisted decoding asks this diffusion model for drafts
        if is_assistant_call(kwargs):
            return draft_as_assistant(model, *args, **kwargs)
        check_call(model, args, kwargs)
        if kwargs.get("custom_generate") is None:
            kwargs["custom_generate"] = dllm_generate
        args, kwargs = heal_tokens_first(model, args, kwargs)
        kwargs = stop_strings_as_criteria(kwargs, model.generation_config)
        return GenerationMixin.generate(model, *args, decoding_strategy=decoding_strategy, **kwargs)


__all__ = ["DllmGenerationMixin", "generate_with_strategy", "heal_tokens_first", "stop_strings_as_criteria"]
