"""Fast-dLLM v2 sub-block threshold decoding (the family's Hub `generate`; Wu et al., arXiv 2509.26328 §3.3).

Blocks of `bd_size` (32) tokens on the block grid from position 0, decoded in sub-blocks (`sub_block_size`, 8)
strictly left to right; each denoising forward covers the whole block (cache read-only) and commits, inside the
current sub-block, every masked position whose confidence exceeds `confidence_threshold` plus always the most
confident one. A finished block is written to the cache in its own forward, whose last logit gives the next
block's first token (right shift; `BlockDiffusionStrategy.commit_from_carry`). It is block diffusion with
`sub_block_size`, `low_confidence_dynamic` and separate writes, so the class only sets those defaults.

Differences from the Hub loop, all bug fixes or generalisations: a prompt of exactly one block is prefilled
(the Hub condition is `P > B`); batches of any size sample per row (NVlabs/Fast-dLLM #64); the mask token and
stop ids come from the model, not constants; the first token of a block is drawn with the same sampling
transform as the others (the Hub takes the argmax even when sampling; identical at temperature 0); the default
threshold is the recommended 0.9 (`v2/run_chatbot.py`), not the Hub signature's 1.0 (one token per step).
The Hub's approximate sub-block cache (`use_block_cache`) is not built.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from .block_diffusion import BlockDiffusionConfig, BlockDiffusionStrategy


@dataclass
class FastDLLMV2Config(BlockDiffusionConfig):
    """Fast-dLLM v2 decoding: block diffusion with sub-blocks and the threshold rule.

    Args (defaults that differ from `BlockDiffusionConfig`):
        sub_block_size (`int`, defaults to 8): Hub `small_block_size`.
        confidence_threshold (`float`, defaults to 0.9): Hub `threshold`; 1.0 commits one token per step.
        fuse_cache_write (`bool`, defaults to False): the block write is its own forward and yields the next
            block's first token (the Hub accounting).
    `block_size` defaults to the checkpoint's `bd_size` (32).

    Presets: the diffusion baselines of S2D2 §5.1 Table 2 (`fast-dllm-v2-config-a/b/c`: sub-blocks 4, 8, 32 at
    threshold 0.9) and its AR-style baseline (`fast-dllm-v2-ar-style`: blocks of 4, sub-blocks of 1).
    """

    decoding_strategy: ClassVar[str] = "fast_dllm_v2"
    presets: ClassVar[dict[str, dict[str, Any]]] = {
        "fast-dllm-v2-config-a": {"block_size": 32, "sub_block_size": 4, "confidence_threshold": 0.9},
        "fast-dllm-v2-config-b": {"block_size": 32, "sub_block_size": 8, "confidence_threshold": 0.9},
        "fast-dllm-v2-config-c": {"block_size": 32, "sub_block_size": 32, "confidence_threshold": 0.9},
        "fast-dllm-v2-ar-style": {"block_size": 4, "sub_block_size": 1, "confidence_threshold": 0.9},
    }

    sub_block_size: int | None = 8
    confidence_threshold: float = 0.9
    fuse_cache_write: bool = False


class FastDLLMV2Strategy(BlockDiffusionStrategy):
    """Fast-dLLM v2's sub-block threshold decoder (the family baseline), batched and with an exact cache."""

    name = "fast_dllm_v2"
    config_class = FastDLLMV2Config
    paper = "Fast-dLLM v2 (arXiv 2509.26328) §3.3; NVlabs/Fast-dLLM v2 generate"
