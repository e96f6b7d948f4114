"""SDAR (JetAstra/SDAR, Hub `JetLM/SDAR-*`) on transformers' own Qwen3 modeling, without remote code.

A Hub SDAR directory (`config.json` with `model_type: "sdar"`, `block_size`, `mask_token_id`, Qwen3
parameter names, safetensors) loads with `AutoModelForCausalLM.from_pretrained(path)` once this module is
registered (`hf_dllm_spec.register_auto_classes()` does it; `SDARForCausalLM.from_pretrained(path)`
needs no registration). Source: JetAstra/SDAR and its Hub checkpoints (`JetLM/SDAR-*`).

- Architecture: Qwen3 (q_norm/k_norm before RoPE, GQA, no qkv bias); the Hub parameter names are
  exactly transformers' Qwen3 names, so weights load without renaming.
- Position-aligned: logits at i predict the token at i.
- Mask token from `config.mask_token_id` (151669 on the Hub checkpoints); stop ids from the generation
  config's eos list ([151645, 151643]); trained block size `config.block_size` (4 on the default checkpoints).
- `auto_map`: a Hub repo's own (pointing at its remote code files) is dropped; the one written by
  `hf_dllm_spec.export_checkpoint` (naming its shim modules) is kept, and saving writes the shims again.
- The Hub config asks for `attn_implementation: "flex_attention"` (with flash-attn kernels in the remote
  code). The explicit float 4D masks of the decoding loop need SDPA or eager; the config value is kept as
  `hub_attn_implementation`, and SDPA is used unless `from_pretrained(attn_implementation="eager")` says
  otherwise ("flex_attention", asked for there too, is replaced by SDPA as well).
- The Hub modeling's cache protocol: a forward with a cache writes it only with `store_kv=True` (its scripts,
  e.g. SDAR's `block_diffusion_generate`, pass `store_kv=False` for the denoising forwards). This class writes
  the cache like any transformers model, and honours an explicit `store_kv=False` by rolling the cache back to
  its length before the forward (read-only; `model_patches.hub_generate.read_only_cache_keyword`, shared with
  LLaDA2 and Fast-dLLM v2); the library's own runner never passes it.
- Quantized weights (bitsandbytes, `from_pretrained(quantization_config=BitsAndBytesConfig(...))`): every
  `nn.Linear` of the decoder (q/k/v/o projections, the MLP) is quantized; the output head `lm_head` stays
  unquantized, in the load dtype (`SDARForCausalLM._keep_in_fp32_modules`); embeddings and norms are not linear
  layers and are never quantized. Rules: `hf_dllm_spec.runtime.weights`.
"""

from __future__ import annotations

from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3Model

from .base import FamilyPatch
from .generation import DllmGenerationMixin
from .hub_generate import read_only_cache_keyword
from .remote_code import ShimsConfigMixin


class SDARConfig(ShimsConfigMixin, Qwen3Config):
    """Qwen3 config plus SDAR's fields.

    Args:
        block_size (`int`, defaults to 4): training block size, in tokens.
        mask_token_id (`int`, *optional*): the mask token (151669 on the Hub checkpoints).
        fuse_cross_entropy (`bool`, *optional*): training-only flag of the Hub code, kept for round trips.
    """

    base_model_class_name = "SDARModel"
    causal_lm_class_name = "SDARForCausalLM"
    model_type = "sdar"

    def __init__(self, block_size: int = 4, mask_token_id: int | None = None, fuse_cross_entropy: bool = False,
                 **kwargs):
        self.block_size = block_size
        self.mask_token_id = mask_token_id
        self.fuse_cross_entropy = fuse_cross_entropy
        if kwargs.get("attn_implementation") == "flex_attention":
            self.hub_attn_implementation = kwargs.pop("attn_implementation")
        super().__init__(**kwargs)


class SDARModel(Qwen3Model):
    """The SDAR decoder stack (the Hub `auto_map`'s `AutoModel`, `modeling_sdar.SDARModel`): transformers' Qwen3
    model, with the Hub's parameter names (`embed_tokens`, `layers.*`, `norm`)."""

    config_class = SDARConfig


class SDARForCausalLM(DllmGenerationMixin, Qwen3ForCausalLM):
    """SDAR causal LM: transformers' Qwen3 modeling with `generate(decoding_strategy=...)`.

    >>> from model_patches.sdar import SDARConfig, SDARForCausalLM
    >>> cfg = SDARConfig(vocab_size=99, hidden_size=32, intermediate_size=37, num_hidden_layers=2,
    ...                  num_attention_heads=4, num_key_value_heads=2, head_dim=8, mask_token_id=98)
    >>> model = SDARForCausalLM(cfg).eval()
    >>> out = model.generate(torch.tensor([[1, 2, 3]]), decoding_strategy="s2d2", max_new_tokens=8,
    ...                      eos_token_id=None)  # doctest: +SKIP
    """

    config_class = SDARConfig
    # The output head stays unquantized. transformers skips it on its own (`get_keys_to_not_convert`: tied and
    # output embeddings) unless `llm_int8_skip_modules` is given, which replaces those defaults (a head tied to
    # the embedding then fails in bitsandbytes); every quantizer adds this list to its skip list. Anchored: the
    # list is also the float16 dtype plan (searched in parameter names), where "lm_head" would load an untied
    # head in float32 beside float16 hidden states; "lm_head$" names the module only (no parameter is upcast).
    _keep_in_fp32_modules = ["lm_head$"]

    #: Qwen3's forward; `store_kv=False` (the Hub SDAR modeling's keyword) leaves a given cache as it was, `True`
    #: or unset writes it (see the module docstring).
    forward = read_only_cache_keyword("store_kv", "SDAR")(Qwen3ForCausalLM.forward)


class SDARPatch(FamilyPatch):
    family = "SDAR"
    model_types = ("sdar",)
    alignment = "position"
    #: S2D2 UCB progress counts only tokens decoded in the block, not the prompt tail sharing it (the S2D2
    #: reference `SDAR/generate_ssd_policy.py::block_diffusion_generate`: `block_unmasked_count` starts at 0
    #: per block and grows by the tokens each step commits). Same as the base default, stated for the record.
    ucb_progress_counts_prompt_tail = False
    auto_classes = ((SDARConfig, SDARForCausalLM),)
    base_model_classes = ((SDARConfig, SDARModel),)
