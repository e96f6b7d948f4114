"""The family adapter: what the decoding loop needs to know about a model family.

A `FamilyPatch` is stateless. It resolves the mask token, stop ids and trained block size from a loaded
model, states the prediction alignment, and runs one forward with an explicit float 4D mask, explicit
`position_ids` and a `DynamicCache` (transformers 5.x; the cache keyword of each version comes from
:mod:`model_patches.compat`). This package never imports the decoding library (`hf_dllm_spec`): the library
reaches a patch through :func:`model_patches.get_patch`, and the model classes reach the library's `generate`
through the decoding backend that :mod:`model_patches.generation` finds by entry point.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from transformers import DynamicCache, PreTrainedModel

from .compat import cache_kwarg

#: Prediction alignments. "position": logits at i predict the token at i (SDAR, LLaDA2).
#: "right_shift": logits at i - 1 predict the token at i (Fast-dLLM v2, Open-dCoder, AR models).
ALIGNMENTS = ("position", "right_shift")


class FamilyPatch:
    """Base adapter; subclasses set the class attributes and may override the hooks.

    Attributes:
        family (`str`): human name, used in messages.
        model_types (`tuple[str, ...]`): `config.model_type` values this patch serves.
        alignment (`str`): one of :data:`ALIGNMENTS`, the family default; a model may declare its own with
            `config.dllm_alignment` (see :meth:`alignment_of`).
        supports_kv_cache (`bool`): whether read-only / store forwards through `DynamicCache` are valid.
        is_diffusion_lm (`bool`): trained as a (block) diffusion LM with a mask token.
        native_strategy (`str` or `None`): the `decoding_strategy` the family's own code decodes with, run by
            `generate()` on the library's model classes when no strategy is named and none is stored;
            `None` for autoregressive families (stock `generate`).
        ucb_progress_counts_prompt_tail (`bool`): whether the block-progress context of S2D2's
            `contextual_bandit_ucb` routing (S2D2 App. A.6, Eq. 16) counts a prompt tail that shares the block
            as already decoded (decoded = B - |M_t|) or counts only the tokens decoded inside the block
            (decoded = B - tail - |M_t|); see `hf_dllm_spec.maths.routing.ucb_progress_bin`. The paper does not say;
            each family follows its S2D2 reference implementation (github.com/phymhan/S2D2): SDAR's
            `SDAR/generate_ssd_policy.py` resets a per-block counter to 0 at each block and adds the tokens each
            step commits (False); Fast-dLLM v2's `Fast-dLLM-v2/generate_policy_utils.py` counts the non-mask
            positions of the sub-block (True). The default, False, is SDAR's, the paper's main family: the
            Qwen patch, which serves SDAR weights stored in the Qwen layout, and the causal-LM fallback inherit
            it. The two agree whenever the block holds no prompt tail (a block-aligned prompt, every later block).
    """

    family: ClassVar[str] = ""
    model_types: ClassVar[tuple[str, ...]] = ()
    alignment: ClassVar[str] = "position"
    supports_kv_cache: ClassVar[bool] = True
    is_diffusion_lm: ClassVar[bool] = True
    native_strategy: ClassVar[str | None] = "block_diffusion"
    ucb_progress_counts_prompt_tail: ClassVar[bool] = False

    #: `(config class, causal-LM class)` pairs to register with the Auto classes (families with their own classes).
    auto_classes: ClassVar[tuple[tuple[type, type], ...]] = ()
    #: `(config class, base model class)` pairs to register with `AutoModel` (where the Hub `auto_map` names one).
    base_model_classes: ClassVar[tuple[tuple[type, type], ...]] = ()

    def alignment_of(self, model: PreTrainedModel) -> str:
        """The model's prediction alignment: `config.dllm_alignment` if set, else the family default.

        Raises:
            ValueError: if `config.dllm_alignment` is not one of :data:`ALIGNMENTS`.
        """
        declared = getattr(model.config, "dllm_alignment", None)
        if declared is None:
            return self.alignment
        if declared not in ALIGNMENTS:
            raise ValueError(
                f"`config.dllm_alignment` (={declared!r}) must be one of {', '.join(map(repr, ALIGNMENTS))}; set "
                "'position' when logits at i predict token i (SDAR, LLaDA2), 'right_shift' when they predict i + 1 "
                "(AR models, Fast-dLLM v2)."
            )
        return declared

    def vocab_size(self, model: PreTrainedModel) -> int:
        """Rows of the output embedding (the distribution's size V)."""
        head = model.get_output_embeddings()
        return int(head.weight.shape[0]) if head is not None else int(model.config.vocab_size)

    # -- tokens -----------------------------------------------------------------------------------------------
    def mask_token_id(self, model: PreTrainedModel, override: int | None = None) -> int | None:
        """Mask token id: `override`, else `config.mask_token_id`, else `generation_config.mask_token_id`.

        Never a hard-coded constant (mask ids differ between families, e.g. SDAR 151669, Fast-dLLM v2 151665).
        Returns `None` when none is found; the caller raises.
        """
        if override is not None:
            return int(override)
        for source in (model.config, getattr(model, "generation_config", None)):
            value = getattr(source, "mask_token_id", None)
            if value is not None:
                return int(value)
        return None

    def stop_token_ids(self, model: PreTrainedModel, generation_config: Any) -> list[int]:
        """Stop ids: `generation_config.eos_token_id` (an int or a list).

        As in transformers' `generate`, the call's generation config decides: `eos_token_id=None` passed to
        `generate` disables stopping. Only without a generation config (`None`) are the model's own generation
        config and then `config.eos_token_id` read.
        """
        if generation_config is None:
            generation_config = getattr(model, "generation_config", None)
            eos = getattr(generation_config, "eos_token_id", None)
            if eos is None:
                eos = getattr(model.config, "eos_token_id", None)
        else:
            eos = generation_config.eos_token_id
        if eos is None:
            return []
        return [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])]

    def trained_block_size(self, model: PreTrainedModel) -> int | None:
        """Block size the checkpoint was trained with (`config.block_size`), or `None` if unknown."""
        value = getattr(model.config, "block_size", None)
        return int(value) if value is not None else None

    def max_positions(self, model: PreTrainedModel) -> int | None:
        """Number of positions the model supports (`config.max_position_embeddings`), or `None`."""
        return getattr(model.config, "max_position_embeddings", None)

    def attention_window(self, model: PreTrainedModel) -> int | None:
        """The sliding window of the model's sliding-attention layers in positions, or `None` when every layer
        attends fully: a `"sliding_attention"` entry in `config.layer_types`, or (configs without `layer_types`,
        e.g. Mistral) a `sliding_window` not switched off by `use_sliding_window=False`.

        The decoding loop passes one full (block-)causal mask to every layer, and `new_cache` keeps only the last
        window of a sliding layer (which cannot be rolled back once full): both agree with the model only while a
        sequence stays below the window (the plan refuses longer ones)."""
        config = model.config.get_text_config()
        window = getattr(config, "sliding_window", None)
        layer_types = getattr(config, "layer_types", None)
        if layer_types is not None:
            return window if window is not None and "sliding_attention" in layer_types else None
        return window if window is not None and getattr(config, "use_sliding_window", True) else None

    # -- forward ----------------------------------------------------------------------------------------------
    def new_cache(self, model: PreTrainedModel) -> DynamicCache:
        """An empty v5 `DynamicCache` for this model."""
        return DynamicCache(config=model.config)

    def forward(
        self,
        model: PreTrainedModel,
        input_ids: torch.Tensor,
        *,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        cache: DynamicCache | None,
        logits_to_keep: int = 0,
    ) -> torch.Tensor:
        """One forward with explicit layout.

        Args:
            input_ids (`torch.Tensor` of shape `(N, q)`, int64).
            position_ids (`torch.Tensor` of shape `(N, q)`, int64): may repeat (RoPE copies, S2D2 2L layout).
            attention_mask (`torch.Tensor` of shape `(N, 1, q, cache_len + q)`): additive float mask in the
                model's dtype (0 = attend, finfo.min = blocked), used as given.
            cache (`DynamicCache` or `None`): appended to with the q new K/V; the caller crops what
                must not persist ("read without extending" = forward, then `crop(-q)`).
            logits_to_keep (`int`, defaults to 0): compute logits only for the last n rows (0 = all).

        Returns:
            `torch.Tensor` of shape `(N, n, V)`, float32 raw logits, position-aligned or right-shifted as
            :meth:`alignment_of` states (the runner applies the alignment).
        """
        out = model(
            input_ids=input_ids,
            position_ids=position_ids,
            attention_mask=attention_mask,
            use_cache=cache is not None,
            **cache_kwarg(cache),
            logits_to_keep=logits_to_keep,
        )
        return out.logits.float()
