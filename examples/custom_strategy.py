"""A third-party decoding strategy with a parameter of its own, added to hf-dllm-spec without touching the library.

`burst` is block diffusion (`BlockDiffusionStrategy`) that commits at least `first_step_tokens` tokens (the most
confident ones) in the first denoising step of every block, then follows the usual confidence rule: fewer forwards
per block, at some risk to quality. Importing this module registers it; then every entry point runs it:

    import examples.custom_strategy                              # registers "burst"
    out = model.generate(ids, decoding_strategy="burst", first_step_tokens=3, max_new_tokens=32)
    out = qwen.generate(ids, custom_generate=hf_dllm_spec.custom_generate, decoding_strategy="burst",
                        first_step_tokens=3, mask_token_id=mask_id, block_size=4)   # no trained block size

The command line and the server find strategies that an installed package declares under the entry point group
`hf_dllm_spec.strategies` (in that package's pyproject.toml):

    [project.entry-points."hf_dllm_spec.strategies"]
    burst = "custom_strategy:BurstStrategy"

    hf-dllm-spec generate --prompt "..." --strategy burst --first-step-tokens 3
    hf-dllm-spec serve models/sdar-tiny-arith        # requests may then name decoding_strategy="burst"

Run as a script, it decodes one arithmetic prompt of the bundled model with `block_diffusion` and with `burst`, both
static (one token per denoising step, `confidence_threshold=1.0`), where the burst's saving shows: on the CPU in
float32, 18 and 10 forwards for the same 16 tokens. (At the default threshold the trained model already commits
most blocks in one or two steps, and both take 7.)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from hf_dllm_spec import BlockDiffusionConfig, register_strategy
from hf_dllm_spec.strategies.block_diffusion import BlockDiffusionStrategy
from hf_dllm_spec.validation import check_int


@dataclass
class BurstConfig(BlockDiffusionConfig):
    """Block diffusion with a burst of commits in each block's first denoising step.

    Args:
        first_step_tokens (`int`, defaults to 2): tokens committed at least in the first step of every block (the
            most confident masked positions; at most the block's masks). Plus every `BlockDiffusionConfig` field.
    """

    decoding_strategy: ClassVar[str] = "burst"

    first_step_tokens: int = 2

    def validate(self) -> None:
        super().validate()
        check_int("first_step_tokens", self.first_step_tokens, 1, "pass a positive number of tokens, e.g. 2")


@register_strategy
class BurstStrategy(BlockDiffusionStrategy):
    """`BlockDiffusionStrategy` whose first denoising step of every block commits at least `first_step_tokens`."""

    name = "burst"
    config_class = BurstConfig
    paper = "an example of a third-party strategy"

    def tokens_per_step(self, block) -> torch.Tensor:
        """k per row `(N,)`: the usual schedule, raised to `first_step_tokens` in a block's first step."""
        k = torch.as_tensor(super().tokens_per_step(block), device=block.step.device).expand_as(block.step)
        return torch.where(block.step == 0, k.clamp(min=self.config.first_step_tokens), k)


if __name__ == "__main__":
    import argparse

    from hf_dllm_spec.tools.jobs.evaluation import ROOT, arithmetic_prompts, load

    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args()     # --help; no other arguments

    tokenizer, model = load(ROOT / "models" / "sdar-tiny-arith")
    ids = tokenizer(arithmetic_prompts(ROOT / "models" / "sdar-tiny-arith", 1)[0].text, return_tensors="pt").input_ids
    for strategy, extra in (("block_diffusion", {}), ("burst", {"first_step_tokens": 3})):
        out = model.generate(ids, decoding_strategy=strategy, max_new_tokens=16, confidence_threshold=1.0,
                             return_dict_in_generate=True, **extra)
        text = tokenizer.decode(out.sequences[0, ids.shape[1]:], skip_special_tokens=True)
        print(f"{strategy:>15}: {out.spec_stats.num_forward_calls} forwards  {text!r}")
