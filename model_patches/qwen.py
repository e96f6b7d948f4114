"""Plain Qwen2 / Qwen3 causal LMs reached through `generate(custom_generate=...)`.

transformers' own modeling runs unchanged. A Qwen checkpoint is an autoregressive model, so the family is
right-shifted (logits at i predict token i + 1): `decoding_strategy="ar"` reproduces transformers' greedy
`generate`. Diffusion weights stored in the Qwen layout declare their alignment in the config: SDAR weights
loaded as `qwen3` set `config.dllm_alignment = "position"`. The mask token comes from `config.mask_token_id`,
`generation_config.mask_token_id` or the `mask_token_id=` argument of `generate`; an AR checkpoint has none
and is refused by the diffusion strategies.
"""

from __future__ import annotations

from .base import FamilyPatch


class QwenPatch(FamilyPatch):
    family = "Qwen (transformers modeling)"
    model_types = ("qwen3", "qwen2")
    alignment = "right_shift"
    is_diffusion_lm = False
    native_strategy = None
