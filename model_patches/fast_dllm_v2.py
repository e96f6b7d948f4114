"""Fast-dLLM v2 (NVlabs/Fast-dLLM `v2/`, Hub `Efficient-Large-Model/Fast_dLLM_v2_*`) on transformers' Qwen2.

Fast-dLLM v2 fine-tunes Qwen2.5 into a block-diffusion model (Wu et al., "Fast-dLLM v2: Efficient Block-Diffusion
LLM", arXiv 2509.26328). Its Hub remote code pins transformers 4.53.1; here the Hub directory
(`config.json` with `model_type: "Fast_dLLM_Qwen"`, `bd_size`, Qwen2.5 parameter names, safetensors) loads with
`AutoModelForCausalLM.from_pretrained(path)` once registered (`hf_dllm_spec.register_auto_classes()`), or with
`Fast_dLLM_QwenForCausalLM.from_pretrained(path)`, and without `trust_remote_code`.

- Architecture: Qwen2 (q/k/v projections with bias, no q/k norm, GQA): transformers' own Qwen2 modeling; the
  Hub parameter names are exactly its names. The 7B checkpoint has its own `lm_head.weight`; the tied 1.5B
  checkpoint has none (`tie_word_embeddings: true`), and the head is tied to `model.embed_tokens.weight`.
- Right-shifted: the logits at i - 1 predict the token at i (trained with the causal-LM loss on the noisy copy).
- Mask token: the Hub config has no mask field and the tokenizer's `mask_token` is unset; the token is the
  additional special token `|<MASK>|` (151665 on the Hub tokenizers). It is resolved, in this order, from
  `generate(mask_token_id=...)` (or the drop-in `mask_id=`), `config.mask_token_id`, `generation_config.mask_token_id`,
  and the `|<MASK>|` entry of the tokenizer files saved beside the weights (read by `from_pretrained`, which
  then sets `config.mask_token_id`). Never a constant.
- Stop ids: the generation config's eos list ([151645, 151643] on the Hub).
- Trained block size: `bd_size` (32); decoding splits blocks into sub-blocks (`sub_block_size`, 8).
- `conplemenrary_mask` (sic), a training flag of the Hub config, is kept and written back as spelled.
- The Hub modeling's cache keyword `update_past_key_values=False` (read-only: the cache is not written) is
  honoured (`model_patches.hub_generate.read_only_cache_keyword`); unset or True writes as any transformers model.
- `generate()` without `decoding_strategy` runs the family's decoder (`decoding_strategy="fast_dllm_v2"`), and
  accepts the Hub `generate` keywords (:data:`HUB_GENERATE_KEYWORDS`).
- Quantized weights (bitsandbytes, `from_pretrained(quantization_config=BitsAndBytesConfig(...))`): every
  `nn.Linear` of the decoder (q/k/v with bias, o, the MLP) is quantized; the output head `lm_head` (tied on the
  1.5B, its own on the 7B) stays unquantized, in the load dtype (`Fast_dLLM_QwenForCausalLM._keep_in_fp32_modules`).
  Rules: `hf_dllm_spec.runtime.weights`.
"""

from __future__ import annotations

from typing import Any

from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen2Model

from .base import FamilyPatch
from .generation import DllmGenerationMixin
from .hub_generate import (MaskTokenFromFilesMixin, hub_temperature, read_only_cache_keyword,
                           rename_hub_keywords)
from .remote_code import ShimsConfigMixin

#: The mask token's string in the Fast-dLLM v2 tokenizers (an additional special token).
MASK_TOKEN = "|<MASK>|"


class Fast_dLLM_QwenConfig(ShimsConfigMixin, Qwen2Config):  # noqa: N801 (the Hub class name)
    """Qwen2 config plus Fast-dLLM v2's fields.

    Args:
        bd_size (`int`, defaults to 32): training block size, in tokens.
        mask_token_id (`int`, *optional*): the mask token; absent from the Hub configs (resolved from the
            tokenizer, see the module docstring).
        conplemenrary_mask (`bool`, *optional*): training-only flag of the Hub config (spelled as there), kept
            for round trips.
    """

    base_model_class_name = "Fast_dLLM_QwenModel"
    causal_lm_class_name = "Fast_dLLM_QwenForCausalLM"
    model_type = "Fast_dLLM_Qwen"

    def __init__(self, bd_size: int = 32, mask_token_id: int | None = None, **kwargs):
        self.bd_size = bd_size
        self.mask_token_id = mask_token_id
        super().__init__(**kwargs)

    def to_dict(self) -> dict[str, Any]:
        """`PreTrainedConfig.to_dict`; an unset `mask_token_id` is left out, as in the Hub configs."""
        out = super().to_dict()
        if out.get("mask_token_id") is None:
            out.pop("mask_token_id", None)
        return out


#: The Hub `generate`'s default `top_p` when it samples (`temperature > 0`).
HUB_TOP_P = 0.95
#: Hub `generate` keyword -> hf_dllm_spec parameter (`temperature`, `top_p` and `use_block_cache`: see
#: :func:`map_hub_generate_kwargs`).
HUB_GENERATE_KEYWORDS: dict[str, str] = {
    "threshold": "confidence_threshold",
    "small_block_size": "sub_block_size",
    "block_size": "block_size",
    "mask_id": "mask_token_id",
    "stop_token": "eos_token_id",
}


def map_hub_generate_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """Translate the Hub `Fast_dLLM_QwenForCausalLM.generate` keywords into this library's parameters.

    `threshold` -> `confidence_threshold`, `small_block_size` -> `sub_block_size`, `mask_id` -> `mask_token_id`,
    `stop_token` -> `eos_token_id` (stop ids); `temperature=0` (the Hub default) means greedy: `do_sample=False`
    and `top_p` dropped; `temperature > 0` without `do_sample` means `do_sample=True` with that temperature and
    `top_p` (the Hub default 0.95 when not given);
    `use_block_cache=False` is the only value (the Hub's sub-block cache is approximate and not built).
    Keywords that are already this library's names pass through unchanged.

    Raises:
        NotImplementedError: for `use_block_cache=True`.
        ValueError: for a negative `temperature`, or a Hub keyword given together with the name it maps to
            (e.g. `threshold` and `confidence_threshold`).
    """
    out = dict(kwargs)
    if out.pop("use_block_cache", False):
        raise NotImplementedError(
            "`use_block_cache` (=True) is not supported: the Hub's sub-block cache is approximate (each sub-block's "
            "first position reads its own logit; S2D2 §5.1 disables it too). Drop `use_block_cache`; decoding "
            "with the exact block cache is the default."
        )
    return hub_temperature(rename_hub_keywords(out, HUB_GENERATE_KEYWORDS), default_top_p=HUB_TOP_P)


class Fast_dLLM_QwenModel(Qwen2Model):  # noqa: N801 (the Hub class name)
    """The Fast-dLLM v2 decoder stack (the Hub `auto_map`'s `AutoModel`): transformers' Qwen2 model."""

    config_class = Fast_dLLM_QwenConfig


class Fast_dLLM_QwenForCausalLM(MaskTokenFromFilesMixin, DllmGenerationMixin, Qwen2ForCausalLM):  # noqa: N801 (the Hub class name)
    """Fast-dLLM v2 causal LM: transformers' Qwen2 modeling with `generate(decoding_strategy=...)`.

    `generate(ids, max_new_tokens=...)` runs the family's sub-block threshold decoder; the Hub keywords
    (`threshold`, `small_block_size`, `block_size`, `mask_id`, `stop_token`, `top_p`, `temperature`,
    `use_block_cache`) are accepted and mapped (:func:`map_hub_generate_kwargs`).

    >>> model = AutoModelForCausalLM.from_pretrained("Efficient-Large-Model/Fast_dLLM_v2_7B")   # doctest: +SKIP
    >>> out = model.generate(ids, max_new_tokens=256, threshold=0.9, small_block_size=8)      # doctest: +SKIP
    """

    config_class = Fast_dLLM_QwenConfig
    hub_mask_token = MASK_TOKEN
    # The output head stays unquantized, also when `llm_int8_skip_modules` replaces transformers' default skips
    # (see `model_patches.sdar.SDARForCausalLM`). Anchored: "lm_head" would also be the float16 dtype plan of the
    # untied 7B head (float32 head, float16 hidden states: a dtype error); "lm_head$" names the module only.
    native_decoding_strategy = "fast_dllm_v2"
    _keep_in_fp32_modules = ["lm_head$"]
    #: Qwen2's forward; `update_past_key_values=False` (the Hub Fast-dLLM v2 modeling's keyword) leaves a given cache
    #: as it was, `True` or unset writes it.
    forward = read_only_cache_keyword("update_past_key_values", "Fast-dLLM v2")(Qwen2ForCausalLM.forward)

    def generate(self, *args, **kwargs):
        """`DllmGenerationMixin.generate` with the Hub keywords mapped (see :func:`map_hub_generate_kwargs`)."""
        return super().generate(*args, **map_hub_generate_kwargs(kwargs))


class FastDLLMV2Patch(FamilyPatch):
    """The Fast-dLLM v2 adapter (`model_type` "Fast_dLLM_Qwen"): right-shifted alignment, native strategy
    `fast_dllm_v2`, trained block size `config.bd_size`, and the family's classes to register with the Auto
    classes (see the module docstring)."""

    family = "Fast-dLLM v2"
    model_types = ("Fast_dLLM_Qwen",)
    alignment = "right_shift"
    native_strategy = "fast_dllm_v2"
    #: S2D2 UCB progress counts a prompt tail sharing the (sub-)block as decoded (the S2D2 reference
    #: `Fast-dLLM-v2/generate_policy_utils.py::generate_ssd_policy`: the non-mask positions of the sub-block).
    ucb_progress_counts_prompt_tail = True
    auto_classes = ((Fast_dLLM_QwenConfig, Fast_dLLM_QwenForCausalLM),)
    base_model_classes = ((Fast_dLLM_QwenConfig, Fast_dLLM_QwenModel),)

    def trained_block_size(self, model) -> int | None:
        """`config.bd_size` (32 on the Hub checkpoints)."""
        value = getattr(model.config, "bd_size", None)
        return int(value) if value is not None else None
