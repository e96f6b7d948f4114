"""Plain Qwen2 / Qwen3 causal LMs reached through `generate(custom_generate=...)`.

transformers' own modeling runs unchanged. The model is treated as a position-aligned block-diffusion LM
(the layout of SDAR weights loaded as `qwen3`); its mask token must come from `config.mask_token_id`,
`generation_config.mask_token_id` or the `mask_token_id=` argument of `generate`. An AR-trained Qwen
checkpoint has no mask token and is refused by the diffusion strategies.
"""

from __future__ import annotations

from .base import FamilyPatch


class QwenPatch(FamilyPatch):
    family = "Qwen (transformers modeling)"
    model_types = ("qwen3", "qwen2")
    alignment = "position"
