"""`generate(decoding_strategy=...)` for model classes: a thin layer over the `custom_generate` callable.

This module imports nothing of the decoding code at import time, so model classes in `model_patches` can
inherit from :class:`DllmGenerationMixin` without an import cycle (`hf_dllm_spec.generation` imports
`model_patches`, never the other way round).
"""

from __future__ import annotations

from typing import Any

from transformers import GenerationMixin, StoppingCriteriaList, StopStringCriteria


def stop_strings_as_criteria(kwargs: dict[str, Any]) -> dict[str, Any]:
    """Turn `stop_strings=` (+ `tokenizer=`) into a `StopStringCriteria` in `stopping_criteria`.

    transformers drops `tokenizer` before calling a `custom_generate` callable and then cannot build the
    stop-string criterion itself; built here, it reaches the decoding loop like any other criterion.

    Raises:
        ValueError: if `stop_strings` is given without `tokenizer`.
    """
    stop_strings = kwargs.pop("stop_strings", None)
    if stop_strings is None:
        return kwargs
    tokenizer = kwargs.pop("tokenizer", None)
    if tokenizer is None:
        raise ValueError(f"`stop_strings` (={stop_strings!r}) must come with `tokenizer`; pass "
                         "tokenizer=<the model's tokenizer> to generate.")
    criteria = StoppingCriteriaList(kwargs.pop("stopping_criteria", None) or [])
    criteria.append(StopStringCriteria(tokenizer, stop_strings))
    kwargs["stopping_criteria"] = criteria
    return kwargs


class DllmGenerationMixin(GenerationMixin):
    """Adds `decoding_strategy=` to `generate`; without it the stock `generate` runs unchanged.

    Every other argument is transformers' own (`streamer`, `assistant_model`, `attention_mask`, ...) or a
    strategy parameter; `draft_model=` names a drafter for the strategies that use one.

    >>> out = model.generate(input_ids, decoding_strategy="s2d2", max_new_tokens=64,
    ...                      generator=torch.Generator().manual_seed(0))  # doctest: +SKIP
    """

    def generate(self, *args, decoding_strategy: str | None = None, **kwargs):
        """`GenerationMixin.generate`, or `hf_dllm_spec.dllm_generate` when `decoding_strategy` is given.

        With an explicit `custom_generate` (the callable, or a Hub folder such as this repository's), the call is
        transformers' own and `decoding_strategy` is handed to it.

        Raises:
            ValueError: for an unknown strategy (before input preparation).
        """
        if decoding_strategy is None:
            return super().generate(*args, **kwargs)
        from .generation import dllm_generate
        from .registry import get_strategy

        get_strategy(decoding_strategy)  # unknown names fail here, before input preparation
        if kwargs.get("custom_generate") is None:
            kwargs["custom_generate"] = dllm_generate
        return super().generate(*args, decoding_strategy=decoding_strategy, **stop_strings_as_criteria(kwargs))
