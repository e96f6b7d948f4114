"""`generate(decoding_strategy=...)` for model classes: a thin layer over the `custom_generate` callable.

This module imports nothing of the decoding code at import time, so model classes in `model_patches` can
inherit from :class:`DllmGenerationMixin` without an import cycle (`hf_dllm_spec.generation` imports
`model_patches`, never the other way round).
"""

from __future__ import annotations

from typing import Any

from transformers import GenerationMixin, StoppingCriteriaList, StopStringCriteria

from .validation import invalid


def stop_strings_as_criteria(kwargs: dict[str, Any]) -> dict[str, Any]:
    """Turn `stop_strings=` (+ `tokenizer=`) into a `StopStringCriteria` in `stopping_criteria`.

    transformers drops `tokenizer` before calling a `custom_generate` callable and then cannot build the
    stop-string criterion itself; built here, it reaches the decoding loop like any other criterion. (On a plain
    transformers model's `custom_generate=` path, `stop_strings` is a parameter of the callable, which reads the
    tokenizer from the `generate` call: `hf_dllm_spec.generation.dllm_generate`.)

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

    Checks the raw call first (:func:`hf_dllm_spec.checks.check_call`), heals the prompt when asked
    (:func:`heal_tokens_first`) and turns `stop_strings` into a criterion (:func:`stop_strings_as_criteria`),
    the two things transformers cannot do for a `custom_generate` callable.

    Raises:
        ValueError: for an unknown strategy, `input_ids` that are not a 2D integer tensor, a budget that is not
            an integer, a model on the meta device (all before transformers prepares the inputs).
    """
    from .checks import check_call
    from .generation import dllm_generate
    from .registry import get_strategy

    get_strategy(decoding_strategy)  # unknown names fail here, before input preparation
    check_call(model, args, kwargs)
    if kwargs.get("custom_generate") is None:
        kwargs["custom_generate"] = dllm_generate
    args, kwargs = heal_tokens_first(model, args, kwargs)
    return GenerationMixin.generate(model, *args, decoding_strategy=decoding_strategy,
                                    **stop_strings_as_criteria(kwargs))


class DllmGenerationMixin(GenerationMixin):
    """`generate` of the library's diffusion model classes: hf_dllm_spec strategies, native decoding by default.

    `generate(decoding_strategy=...)` runs that strategy. Without `decoding_strategy`, a diffusion model decodes
    as a diffusion model: the strategy stored in its `generation_config.dllm_decoding` (with the parameters
    stored there), else its family's native decoding (block diffusion for SDAR), never transformers'
    left-to-right sampling, which on a diffusion model produces garbage. Every other argument is transformers'
    own (`streamer`, `assistant_model`, `attention_mask`, `stop_strings` with `tokenizer`, ...) or a strategy
    parameter; `draft_model=` names a drafter for the strategies that use one.

    >>> out = model.generate(input_ids, max_new_tokens=64)                    # native decoding  # doctest: +SKIP
    >>> out = model.generate(input_ids, decoding_strategy="s2d2", max_new_tokens=64,
    ...                      generator=torch.Generator().manual_seed(0))  # doctest: +SKIP
    """

    def generate(self, *args, decoding_strategy: str | None = None, **kwargs):
        """`hf_dllm_spec.dllm_generate` with `decoding_strategy`, or with the model's default strategy.

        With an explicit `custom_generate` (the callable, or a Hub folder such as this repository's), the call is
        transformers' own and `decoding_strategy` (if given) is handed to it.

        Raises:
            ValueError: for an unknown strategy, `input_ids` that are not a 2D integer tensor, a budget that is
                not an integer, a model on the meta device (all before transformers prepares the inputs).
        """
        if decoding_strategy is None and kwargs.get("custom_generate") is None:
            decoding_strategy = self.default_decoding_strategy(kwargs.get("generation_config"))
        if decoding_strategy is None:
            return super().generate(*args, **kwargs)
        return generate_with_strategy(self, args, kwargs, decoding_strategy)

    def default_decoding_strategy(self, generation_config=None) -> str | None:
        """The strategy `generate()` runs when none is named: the one stored in the generation config (the
        call's, else the model's), else the family's native decoding; `None` for stock `generate`."""
        import model_patches

        from .configuration import GENERATION_CONFIG_KEY

        for gc in (generation_config, self.generation_config):
            stored = getattr(gc, GENERATION_CONFIG_KEY, None) if gc is not None else None
            if stored and stored.get("decoding_strategy"):
                return stored["decoding_strategy"]
        patch = model_patches.get_patch(self)
        return patch.native_strategy if patch.is_diffusion_lm else None
