"""LLaDA2.x threshold decoding with token editing (the family's Hub `generate`), batched and with a KV cache.

LLaDA2.1 (Hub `generate`; LLaDA2.1 tech report §2 Eq. 1-3; `strategies.md` §3): blocks of 32 on the grid from
position 0; each step proposes a token for every block position; mask-to-token commits the masks whose
probability exceeds `confidence_threshold` (tau_mask) if at least `num_to_transfer` of them, else the
`num_to_transfer` most probable; token-to-token editing replaces committed, non-prompt tokens of the current
block whose proposal differs with probability above `editing_threshold` (tau_edit); after the block is full, up to
`max_post_steps` editing-only steps run until one edits nothing. LLaDA2.0 (preset "llada2.0"): no editing, k from
the `steps_per_block` schedule.

Differences from the Hub loop, all fixes or generalisations: a KV cache (prefill once, read-only denoising
forwards, each finished block stored once, fused with the next block's first forward; the Hub recomputes the
whole window at every step); a hard block-causal mask (the 2.1 Hub mask is additive 1/0 and does not block,
families.md §4.5); batches of any size; fp32 as well as bf16; the mask token and stop ids from the model. It is
block diffusion with :class:`~hf_dllm_spec.maths.editing.EditingConfig`, so the class only sets the family defaults.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from ..maths.editing import EditingConfig
from .block_diffusion import BlockDiffusionConfig, BlockDiffusionStrategy


@dataclass
class LLaDA2DecodingConfig(BlockDiffusionConfig, EditingConfig):
    """LLaDA2.1 decoding: the threshold rule with token editing; the LLaDA2.1 Hub `generate` defaults.

    Args (defaults that differ from `BlockDiffusionConfig` / `EditingConfig`):
        confidence_threshold (`float`, defaults to 0.95): tau_mask (Hub `threshold`).
        editing_threshold (`float`, defaults to 0.9): tau_edit; `None` = LLaDA2.0 (no editing).
        max_post_steps (`int`, defaults to 16), num_to_transfer (`int`, defaults to 1).
    `block_size` defaults to the checkpoint's (32 for every LLaDA2.x checkpoint).

    Presets: "llada2.0" (no editing, k from the schedule), "llada2.1-quality" (tau_mask 0.7, tau_edit 0.5; the
    S2D2 paper's Table 3 "Quality" and the diffusers `LLaDA2Pipeline` docs), "llada2.1-conservative" (0.95 / 0.9,
    the Hub defaults), "llada2.1-static" (tau_mask 1: one mask per step, tau_edit 0.9; S2D2 Table 3 "static").
    """

    decoding_strategy: ClassVar[str] = "llada2"
    presets: ClassVar[dict[str, dict[str, Any]]] = {
        "llada2.0": {"editing_threshold": None, "num_to_transfer": None, "max_post_steps": 0},
        "llada2.1-quality": {"confidence_threshold": 0.7, "editing_threshold": 0.5},
        "llada2.1-conservative": {"confidence_threshold": 0.95, "editing_threshold": 0.9},
        "llada2.1-static": {"confidence_threshold": 1.0, "editing_threshold": 0.9},
    }

    confidence_threshold: float = 0.95
    editing_threshold: float | None = 0.9
    max_post_steps: int = 16
    num_to_transfer: int | None = 1

    def validate(self) -> None:
        BlockDiffusionConfig.validate(self)
        EditingConfig.validate(self)


class LLaDA2Strategy(BlockDiffusionStrategy):
    """LLaDA2.x's decoder (the family baseline): threshold decoding with token editing, exact KV cache."""

    name = "llada2"
    config_class = LLaDA2DecodingConfig
    paper = "LLaDA2.1 tech report §2 (Eq. 1-3); inclusionAI LLaDA2.1 Hub generate"
