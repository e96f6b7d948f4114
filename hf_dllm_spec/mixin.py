"""`generate(decoding_strategy=...)` for model classes: a thin layer over the `custom_generate` callable.

This module imports nothing of the decoding code at import time, so model classes in `model_patches` can
inherit from :class:`DllmGenerationMixin` without an import cycle (`hf_dllm_spec.generation` imports
`model_patches`, never the other way round).
"""

from __future__ import annotations

from transformers import GenerationMixin


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
        kwargs.setdefault("custom_generate", dllm_generate)
        if kwargs["custom_generate"] is None:
            kwargs["custom_generate"] = dllm_generate
        return super().generate(*args, decoding_strategy=decoding_strategy, **kwargs)
