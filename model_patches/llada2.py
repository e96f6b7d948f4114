"""LLaDA2.0 / LLaDA2.1 (inclusionAI, Hub `inclusionAI/LLaDA2.*`): an MoE block-diffusion model, without remote code.

Registered under the Hub `model_type` `"llada2_moe"` with the Hub class names (`LLaDA2MoeConfig`,
`LLaDA2MoeModel`, `LLaDA2MoeModelLM`), built from transformers' own pieces: the RMSNorm, the partial rotary
embedding, the routed experts (`@use_experts_implementation`: `grouped_mm` / `batched_mm` dispatch, no host
synchronisation and no Python loop over experts), the group-limited sigmoid router and the MLP of GLM-4-MoE,
whose MoE maths is LLaDA2's (source: `../shared/reference/families.md` §4; the LLaDA2.0 / 2.1 Hub modeling).

- Attention: one fused `query_key_value` projection split [q | k | v] by heads, q/k RMSNorm over `head_dim`
  before RoPE (always, as the Hub modeling, whatever `use_qk_norm` says),
  rotate-half RoPE on the first `partial_rotary_factor * head_dim` dims, output projection `dense`.
- MLP: dense SwiGLU in the first `first_k_dense_replace` layers, then MoE: scores = sigmoid(h W^T) in fp32;
  `expert_bias` is added for the choice only; the top-2 sum of each of `n_group` groups keeps `topk_group`
  groups; top-`num_experts_per_tok` experts inside them; weights = unbiased scores normalised to sum 1, times
  `routed_scaling_factor`; plus the shared expert(s).
- Logits in fp32 (`LLaDA2MoeModelLM.forward` upcasts, as the Hub).
- Attention masks: a 4D mask is used as given (float: additive; bool: True = attend, turned into a hard additive
  mask 0 / dtype min: the 2.1 Hub `generate` adds a 1/0 bf16 mask instead, so its block causality is not
  enforced; families.md §4.5); any query / key length (read-only cache forwards, the S2D2 2L layout). No mask,
  or a 2D padding mask, means bidirectional attention over cache + input (the Hub code crashes without one).
- Loading: Hub safetensors by their own names (`model.word_embeddings`, `attention.query_key_value`, ...).
  Per-expert weights `mlp.experts.{e}.{gate,up,down}_proj.weight` are fused into `mlp.experts.gate_up_proj`
  / `down_proj` and `mlp.gate.expert_bias` is read into the router's bias by a checkpoint conversion mapping
  (registered with transformers by the classes' `from_pretrained` / `save_pretrained`); `save_pretrained`
  reverses it, so saved checkpoints are in the Hub layout.
- Tensor parallelism under torchrun (`from_pretrained(..., distributed_config=DistributedConfig(tp_plan="auto"))`):
  `LLaDA2MoeConfig.base_model_tp_plan` + `LLaDA2MoeModelLM._tp_plan`, transformers' styles; the fused
  `query_key_value` is sharded by rows and gathered, then each rank computes its own head group
  (`LLaDA2MoeAttention.head_group`) and caches its K/V heads; experts, shared expert and dense MLP as GLM-4-MoE,
  router replicated, `lm_head` gathered. Expert parallelism: `base_model_ep_plan` (the installed GLM-4-MoE's). A
  layout that cannot split is refused before any weight loads (:func:`check_parallel_sizes`). The Hub tensors load
  unchanged (each rank reads its slices). docs/placement.md.
- Tokens: the Hub config has no mask id. `config.mask_token_id` (set by `from_pretrained` from the tokenizer
  files' `<|mask|>` when found) else 156895 with a warning (families.md §4.4); EOS 156892 from the config, also
  in the loaded generation config when the checkpoint's files name none (`adjust_generation_fn`).
- Quantized weights (bitsandbytes, `from_pretrained(quantization_config=BitsAndBytesConfig(...))`): bitsandbytes
  replaces exact `nn.Linear` modules only (transformers' `replace_with_bnb_linear`), so only the attention
  (`query_key_value`, `dense`), the shared experts and the dense first layer(s)' MLP are quantized. The routed
  experts are two 3D parameters (`gate_up_proj` `(E, 2I, H)`, `down_proj` `(E, H, I)`) and the router `mlp.gate`
  (GLM-4-MoE's `Glm4MoeTopkRouter`) holds a `weight` parameter: neither is a linear layer, so neither is
  quantized; the experts stay in the load dtype, and the router weight and `e_score_correction_bias` (the Hub's
  `expert_bias`) in float32 for any 16-bit load (`_keep_in_fp32_modules_strict`; the router maths is fp32, as in
  the Hub modeling; families.md §4.10). `lm_head` stays unquantized, in the load dtype (`_keep_in_fp32_modules`).
  On LLaDA2.1-mini (families.md §4.1: 20 layers, hidden 2048, 256 experts of 512, vocab 157184; 16.3B
  parameters) the quantized layers hold about 0.30B parameters (1.9%): the experts (15.3B) and the embedding and
  head (0.64B) stay in the load dtype, so bitsandbytes saves little memory on this family.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn
from transformers import DynamicCache, PreTrainedConfig, PreTrainedModel
from transformers import initialization as init
from transformers.conversion_mapping import register_checkpoint_conversion_mapping
from transformers.core_model_loading import Concatenate, MergeModulelist, WeightConverter, WeightRenaming
from transformers.integrations.moe import use_experts_implementation
from transformers.masking_utils import create_bidirectional_mask
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import CausalLMOutputWithPast, MoeModelOutputWithPast
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.glm4_moe.configuration_glm4_moe import Glm4MoeConfig
from transformers.models.glm4_moe.modeling_glm4_moe import (
    Glm4MoeExperts,
    Glm4MoeMLP,
    Glm4MoeRMSNorm,
    Glm4MoeRotaryEmbedding,
    Glm4MoeTopkRouter,
    apply_rotary_pos_emb,
    eager_attention_forward,
)

from .base import FamilyPatch
from .compat import CACHE_NAMES, accepts_cache_names, cache_field, cache_kwarg, output_cache
from .generation import DllmGenerationMixin
from .hub_generate import (MaskTokenFromFilesMixin, hub_temperature, read_only_cache_keyword,
                           rename_hub_keywords)
from .remote_code import ShimsConfigMixin

try:
    from torch.distributed.tensor import DTensor, Shard
except ImportError:     # a torch built without torch.distributed: nothing is ever sharded
    DTensor = Shard = None

logger = logging.getLogger(__name__)

#: Hub token ids (families.md §4.4): the mask (no config field names it) and the end of text.
HUB_MASK_TOKEN_ID = 156895
HUB_EOS_TOKEN_ID = 156892
#: The block size every LLaDA2.x checkpoint is trained with (the Hub configs do not state it).
HUB_BLOCK_SIZE = 32
MASK_TOKEN = "<|mask|>"


class LLaDA2MoeConfig(ShimsConfigMixin, PreTrainedConfig):
    """LLaDA2.x config with the Hub keys (`inclusionAI/LLaDA2.1-mini` `config.json`).

    Args:
        vocab_size, hidden_size, intermediate_size (dense layers), num_hidden_layers, num_attention_heads,
        num_key_value_heads, head_dim, hidden_act, rms_norm_eps, max_position_embeddings, initializer_range,
        tie_word_embeddings, pad_token_id, eos_token_id: as in any transformers decoder config.
        rope_theta (`float`, defaults to 600000.0) and partial_rotary_factor (`float`, defaults to 0.5): RoPE
            base and the rotated share of each head; stored in `rope_parameters` for transformers' rotary code.
        use_qkv_bias (`bool`, defaults to False): bias of `query_key_value`; use_bias (`bool`, defaults to
            False): bias of `dense`.
        use_qk_norm (`bool`, defaults to True): kept for round trips; q/k RMSNorm is always applied, as by the Hub
            modeling (the 2.0-era config class writes False for checkpoints that have and use the norms).
        num_experts (`int`, 256), num_experts_per_tok (`int`, 8), num_shared_experts (`int`, 1),
        moe_intermediate_size (`int`, 512), first_k_dense_replace (`int`, 1), n_group (`int`, 8),
        topk_group (`int`, 4), routed_scaling_factor (`float`, 2.5), norm_topk_prob (`bool`, True): the MoE
            (`norm_topk_prob` kept for round trips: the Hub modeling normalises iff top-k > 1, and so does this one).
        mask_token_id (`int`, *optional*): the mask token (not in the Hub configs; see the module docstring).
        block_size (`int`, *optional*): trained block size (not in the Hub configs: 32 is assumed).
    Hub keys the Hub modeling never reads (`score_function`, `moe_router_enable_expert_bias`, `router_dtype`,
    `rotary_dim`, `use_rmsnorm`, `norm_head`, `norm_softmax`, `using_split_qkv_in_self_attention`, ...) are kept
    as plain attributes for round trips and have no effect (families.md §8).
    """

    base_model_class_name = "LLaDA2MoeModel"
    causal_lm_class_name = "LLaDA2MoeModelLM"
    model_type = "llada2_moe"
    keys_to_ignore_at_inference = list(CACHE_NAMES)
    # transformers' GLM-4-MoE pieces read these names.
    attribute_map = {"num_local_experts": "num_experts", "n_shared_experts": "num_shared_experts",
                     "attention_bias": "use_qkv_bias"}
    # Tensor parallelism (`DistributedConfig(tp_plan="auto")` under torchrun; docs/placement.md). The MoE and MLP
    # rules are GLM-4-MoE's (same module names). Attention: no transformers style splits an uneven fused [q | k | v]
    # by head group (`packed_colwise` halves equal parts; GPT-NeoX's plain `colwise` needs per-head interleaving), so
    # `query_key_value` is sharded by rows and its output gathered (as Phi-3's fused `qkv_proj`), and each rank then
    # keeps its own head group (`LLaDA2MoeAttention.head_group`): its q heads, its K/V heads (its own KV cache) and
    # the matching input columns of `dense` (rowwise). The router (`mlp.gate`) and the norms stay replicated.
    base_model_tp_plan = {
        "word_embeddings": "embedding_rowwise",          # vocabulary-parallel (transformers 5.24 does it by default)
        "layers.*.attention.query_key_value": "colwise_gather_output",
        "layers.*.attention.dense": "rowwise",
        "layers.*.mlp.experts.gate_up_proj": "packed_colwise",
        "layers.*.mlp.experts.down_proj": "rowwise",
        "layers.*.mlp.experts": "moe_tp_experts",      # after its parameters' rules, as GLM-4-MoE's
        "layers.*.mlp.shared_experts.gate_proj": "colwise",
        "layers.*.mlp.shared_experts.up_proj": "colwise",
        "layers.*.mlp.shared_experts.down_proj": "rowwise",
        "layers.*.mlp.gate_proj": "colwise",
        "layers.*.mlp.up_proj": "colwise",
        "layers.*.mlp.down_proj": "rowwise",
    }
    # Expert parallelism (`ep_size` / `enable_expert_parallel`): the installed GLM-4-MoE's plan, whose style names
    # changed in transformers 5.19 (5.17: `ep_router` + `moe_tp_experts`; 5.24: `ep_dispatch_experts`).
    base_model_ep_plan = dict(Glm4MoeConfig.base_model_ep_plan or {})

    def __init__(self, vocab_size: int = 157184, hidden_size: int = 2048, intermediate_size: int = 5120,
                 num_hidden_layers: int = 20, num_attention_heads: int = 16, num_key_value_heads: int = 4,
                 head_dim: int | None = 128, hidden_act: str = "silu", rms_norm_eps: float = 1e-6,
                 max_position_embeddings: int = 16384, initializer_range: float = 0.006,
                 rope_theta: float = 600000.0, partial_rotary_factor: float = 0.5,
                 rope_parameters: dict | None = None, use_qkv_bias: bool = False, use_bias: bool = False,
                 use_qk_norm: bool = True, attention_dropout: float = 0.0, num_experts: int = 256,
                 num_experts_per_tok: int = 8, num_shared_experts: int | None = 1, moe_intermediate_size: int = 512,
                 first_k_dense_replace: int = 1, n_group: int = 8, topk_group: int = 4,
                 routed_scaling_factor: float = 2.5, norm_topk_prob: bool = True, use_cache: bool = True,
                 tie_word_embeddings: bool = False, pad_token_id: int | None = HUB_EOS_TOKEN_ID,
                 eos_token_id: int | list[int] | None = HUB_EOS_TOKEN_ID, mask_token_id: int | None = None,
                 block_size: int | None = None, **kwargs):
        self.vocab_size, self.hidden_size, self.intermediate_size = vocab_size, hidden_size, intermediate_size
        self.num_hidden_layers, self.num_attention_heads = num_hidden_layers, num_attention_heads
        self.num_key_value_heads = num_key_value_heads
        self.head_dim = head_dim if head_dim is not None else hidden_size // num_attention_heads
        self.hidden_act, self.rms_norm_eps, self.initializer_range = hidden_act, rms_norm_eps, initializer_range
        self.max_position_embeddings = max_position_embeddings
        self.rope_theta, self.partial_rotary_factor = rope_theta, partial_rotary_factor
        self.rope_parameters = rope_parameters or {"rope_type": "default", "rope_theta": rope_theta,
                                                   "partial_rotary_factor": partial_rotary_factor}
        self.use_qkv_bias, self.use_bias, self.use_qk_norm = use_qkv_bias, use_bias, use_qk_norm
        self.attention_dropout = attention_dropout
        self.num_experts, self.num_experts_per_tok = num_experts, num_experts_per_tok
        self.num_shared_experts, self.moe_intermediate_size = num_shared_experts, moe_intermediate_size
        self.first_k_dense_replace, self.n_group, self.topk_group = first_k_dense_replace, n_group, topk_group
        self.routed_scaling_factor, self.norm_topk_prob = routed_scaling_factor, norm_topk_prob
        self.use_cache = use_cache
        self.mask_token_id, self.block_size = mask_token_id, block_size
        self.tie_word_embeddings = tie_word_embeddings
        self.pad_token_id, self.eos_token_id = pad_token_id, eos_token_id
        super().__init__(**kwargs)
        if self.num_experts % self.n_group or self.num_experts // self.n_group < 2:
            raise ValueError(f"`num_experts` (={num_experts}) must be a multiple of `n_group` (={n_group}) with at "
                             "least 2 experts per group (a group is scored by its top-2 sum); pass matching values.")
        if not 1 <= topk_group <= n_group or num_experts_per_tok > topk_group * (num_experts // n_group):
            raise ValueError(f"`topk_group` (={topk_group}) must be in [1, n_group={n_group}] and keep at least "
                             f"`num_experts_per_tok` (={num_experts_per_tok}) experts; pass matching values.")

    def to_dict(self) -> dict[str, Any]:
        """`PreTrainedConfig.to_dict`; unset `mask_token_id` / `block_size` are left out, as in the Hub configs."""
        out = super().to_dict()
        for key in ("mask_token_id", "block_size"):
            if out.get(key) is None:
                out.pop(key, None)
        return out


class LLaDA2MoeAttention(nn.Module):
    """GQA with a fused `query_key_value`, q/k RMSNorm before partial RoPE, and the `dense` output projection.

    Under tensor parallelism (`head_group` = `(r, n)`) it computes q heads `[r*H/n, (r+1)*H/n)` and K/V heads
    `[r*H_kv/n, (r+1)*H_kv/n)` (the ones those q heads read) from the gathered `query_key_value` output, caches
    those K/V heads only, and hands `dense` (sharded `rowwise`) the matching input columns."""

    def __init__(self, config: LLaDA2MoeConfig, layer_idx: int):
        super().__init__()
        self.config, self.layer_idx = config, layer_idx
        self.head_dim = config.head_dim
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.num_key_value_groups = self.num_heads // self.num_kv_heads
        self.scaling = self.head_dim ** -0.5
        self.attention_dropout = config.attention_dropout
        self.is_causal = False
        self.query_key_value = nn.Linear(config.hidden_size, (self.num_heads + 2 * self.num_kv_heads) * self.head_dim,
                                         bias=config.use_qkv_bias)
        self.dense = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=config.use_bias)
        # Always, as the Hub modeling: the 2.0-era config class defaults `use_qk_norm` to False (and re-saved
        # configs carry it) while every checkpoint has and applies the norms (families.md §4.1).
        self.query_layernorm = Glm4MoeRMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.key_layernorm = Glm4MoeRMSNorm(self.head_dim, eps=config.rms_norm_eps)
        # `(rank, ranks)`: this module computes head group `rank` of `ranks` (q heads and the K/V heads they read);
        # set by `LLaDA2MoePreTrainedModel.maybe_distribute_model` when the plan shards `dense` by its input
        # columns (`rowwise`), else all heads.
        self.head_group: tuple[int, int] = (0, 1)

    def forward(self, hidden_states: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor],
                attention_mask: torch.Tensor | None, cache: DynamicCache | None = None, **kwargs):
        """Attention of `hidden_states` over the cached keys and values plus its own (not causal: the mask
        decides).

        Args:
            hidden_states (`torch.Tensor` of shape `(N, q, hidden_size)`): the normalised layer input.
            position_embeddings (`tuple[torch.Tensor, torch.Tensor]`): `(cos, sin)` of the rotary embedding at the
                query positions.
            attention_mask (`torch.Tensor`, *optional*): the mask :func:`additive_mask` built (e.g. an additive
                float mask `(N, 1, q, cache_len + q)`), passed to the attention implementation as given.
            cache (`DynamicCache`, *optional*): this layer's K/V (this rank's heads) are appended to it and the
                whole cached K/V is attended.
            **kwargs: passed to the attention implementation (`config._attn_implementation`).

        Returns:
            `tuple`: the output of `dense`, `(N, q, hidden_size)`, and the attention weights where the
            implementation returns them (eager), else None.
        """
        b, q_len, _ = hidden_states.shape
        qkv = self.query_key_value(hidden_states).view(b, q_len, self.num_heads + 2 * self.num_kv_heads, self.head_dim)
        query, key, value = qkv.split([self.num_heads, self.num_kv_heads, self.num_kv_heads], dim=2)
        rank, ranks = self.head_group
        if ranks > 1:               # this rank's q heads and the K/V heads they read (GQA groups stay whole)
            q, kv = self.num_heads // ranks, self.num_kv_heads // ranks
            query, key, value = query[:, :, rank * q:(rank + 1) * q], key[:, :, rank * kv:(rank + 1) * kv], \
                value[:, :, rank * kv:(rank + 1) * kv]
        query, key = self.query_layernorm(query), self.key_layernorm(key)
        query, key, value = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
        cos, sin = position_embeddings
        query, key = apply_rotary_pos_emb(query, key, cos, sin)
        if cache is not None:
            key, value = cache.update(key, value, self.layer_idx)
        attention = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, eager_attention_forward)
        out, weights = attention(self, query, key, value, attention_mask, scaling=self.scaling,
                                 dropout=0.0 if not self.training else self.attention_dropout, is_causal=False,
                                 **kwargs)
        return self.dense(out.reshape(b, q_len, -1).contiguous()), weights


@use_experts_implementation
class LLaDA2MoeExperts(Glm4MoeExperts):
    """Routed experts as two 3D weights (`gate_up_proj` `(E, 2I, H)`, `down_proj` `(E, H, I)`); transformers picks
    the kernel (`config._experts_implementation`: "grouped_mm" by default, "batched_mm", or "eager")."""


class LLaDA2MoeTopkRouter(Glm4MoeTopkRouter):
    """GLM-4-MoE's group-limited sigmoid router as the LLaDA2 Hub modeling runs it: the top-k weights are normalised
    iff `num_experts_per_tok > 1`, whatever `norm_topk_prob` says (the Hub never reads that key; families.md §8).
    Real checkpoints (top-8, `norm_topk_prob: true`) route the same either way."""

    def __init__(self, config: LLaDA2MoeConfig):
        super().__init__(config)
        self.norm_topk_prob = self.top_k > 1


class LLaDA2MoeSparseMoeBlock(nn.Module):
    """Router (`gate`, :class:`LLaDA2MoeTopkRouter`), routed experts and shared experts."""

    def __init__(self, config: LLaDA2MoeConfig):
        super().__init__()
        self.gate = LLaDA2MoeTopkRouter(config)
        self.experts = LLaDA2MoeExperts(config)
        shared = config.num_shared_experts or 0
        self.shared_experts = (Glm4MoeMLP(config, intermediate_size=config.moe_intermediate_size * shared)
                               if shared else None)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Each token through its routed experts, weighted by the router, plus the shared experts.

        Args:
            hidden_states (`torch.Tensor` of shape `(N, q, hidden_size)`): the normalised input.

        Returns:
            `torch.Tensor` of shape `(N, q, hidden_size)`.
        """
        shape = hidden_states.shape
        _, weights, experts = self.gate(hidden_states)
        out = self.experts(hidden_states.reshape(-1, shape[-1]), experts, weights).view(shape)
        if self.shared_experts is not None:
            out = out + self.shared_experts(hidden_states)
        return out


class LLaDA2MoeDecoderLayer(GradientCheckpointingLayer):
    """One pre-norm decoder layer: attention, then the MLP (dense SwiGLU in the first `first_k_dense_replace`
    layers, the MoE block after), each on its RMSNorm'ed input and added to the residual stream."""

    def __init__(self, config: LLaDA2MoeConfig, layer_idx: int):
        super().__init__()
        self.attention = LLaDA2MoeAttention(config, layer_idx)
        self.mlp = LLaDA2MoeSparseMoeBlock(config) if layer_idx >= config.first_k_dense_replace else Glm4MoeMLP(config)
        self.input_layernorm = Glm4MoeRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = Glm4MoeRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden_states, attention_mask=None, position_embeddings=None, cache=None, **kwargs):
        """Run the layer.

        Args:
            hidden_states (`torch.Tensor` of shape `(N, q, hidden_size)`): the residual stream.
            attention_mask (`torch.Tensor`, *optional*): the mask :func:`additive_mask` built.
            position_embeddings (`tuple[torch.Tensor, torch.Tensor]`): `(cos, sin)` at the query positions.
            cache (`DynamicCache`, *optional*): the K/V cache (see :meth:`LLaDA2MoeAttention.forward`).
            **kwargs: passed to the attention.

        Returns:
            `torch.Tensor` of shape `(N, q, hidden_size)`: the updated residual stream (the attention weights are
            dropped).
        """
        attn, _ = self.attention(self.input_layernorm(hidden_states), position_embeddings, attention_mask,
                                 cache=cache, **kwargs)
        hidden_states = hidden_states + attn
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


class LLaDA2MoePreTrainedModel(PreTrainedModel):
    """Base class of the LLaDA2 models: config class, weight initialisation (router and routed experts included),
    the router kept in float32 for 16-bit loads, the Hub-layout checkpoint conversion of `from_pretrained` /
    `save_pretrained` and, under tensor parallelism, each attention module's head group."""

    config_class = LLaDA2MoeConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["LLaDA2MoeDecoderLayer"]
    _skip_keys_device_placement = list(CACHE_NAMES)
    _supports_sdpa = True
    _supports_flex_attn = True
    _supports_attention_backend = True
    # Router weight and selection bias in float32 for any 16-bit load (as transformers' own MoE routers; the router
    # upcasts to fp32 anyway, so a bf16 checkpoint gives the same scores). "mlp.gate.weight" is searched in parameter
    # names: it matches the router's weight, not `mlp.gate_proj.weight`. Neither is a linear layer: bitsandbytes
    # never quantizes them.
    _keep_in_fp32_modules_strict = ["e_score_correction_bias", "mlp.gate.weight"]

    @classmethod
    def _can_set_experts_implementation(cls) -> bool:
        """True: the routed experts use `@use_experts_implementation`. transformers decides this by searching the
        source of the class's module for that decorator; a subclass defined in a checkpoint's remote-code file (which
        only imports this module) would otherwise fall back to the "eager" experts (a Python loop over experts
        with a host synchronisation per expert, which a CUDA graph cannot capture) instead of "grouped_mm"."""
        return True

    @classmethod
    def maybe_distribute_model(cls, model, distributed_config, *args, **kwargs):
        """transformers' step that shards the (still empty) model for `from_pretrained(distributed_config=...)`,
        after :func:`check_parallel_sizes` has refused a layout this model cannot split (before any weight loads);
        then, where the plan shards `attention.dense` by its input columns (`rowwise`), each attention module is
        told its head group."""
        layout = resolved_parallel_layout(model, distributed_config) if distributed_config is not None else None
        if layout is not None:
            check_parallel_sizes(model.config, *layout)
        model = super().maybe_distribute_model(model, distributed_config, *args, **kwargs)
        if layout is not None and layout[1] > 1 and plan_style(layout[0], "layers.*.attention.dense") == "rowwise":
            for module in model.modules():
                if isinstance(module, LLaDA2MoeAttention):
                    module.head_group = input_shard_group(module.dense.weight)
        return model

    @classmethod
    def from_pretrained(cls, *args, **kwargs):
        """`PreTrainedModel.from_pretrained` with the Hub-layout conversion registered (per-expert weights fused)."""
        register_conversion_mapping()
        return super().from_pretrained(*args, **kwargs)

    def save_pretrained(self, *args, **kwargs):
        """`PreTrainedModel.save_pretrained` in the Hub layout (per-expert weights, `mlp.gate.expert_bias`)."""
        register_conversion_mapping()
        return super().save_pretrained(*args, **kwargs)

    @torch.no_grad()
    def _init_weights(self, module):
        super()._init_weights(module)
        std = self.config.initializer_range
        if isinstance(module, Glm4MoeTopkRouter):
            init.normal_(module.weight, mean=0.0, std=std)
            init.zeros_(module.e_score_correction_bias)
        elif isinstance(module, Glm4MoeExperts):
            init.normal_(module.gate_up_proj, mean=0.0, std=std)
            init.normal_(module.down_proj, mean=0.0, std=std)


def plan_style(plan: dict[str, str], rule: str) -> str | None:
    """The style `plan` gives `rule` (e.g. "layers.*.attention.dense"), under any prefix (the LM's plan names the
    base model's rules "model.layers.*...."); None when it has no such rule."""
    return next((style for key, style in plan.items() if key == rule or key.endswith("." + rule)), None)


def input_shard_group(weight: torch.Tensor) -> tuple[int, int]:
    """`(rank, ranks)` of the mesh dimension that shards a linear `weight` `(out, in)` by its input columns (a
    `DTensor` with a `Shard(1)` placement); `(0, 1)` for a weight that is not sharded so."""
    if DTensor is not None and isinstance(weight, DTensor):
        for mesh_dim, placement in enumerate(weight.placements):
            if isinstance(placement, Shard) and placement.dim in (-1, weight.ndim - 1):
                return weight.device_mesh.get_local_rank(mesh_dim), weight.device_mesh.size(mesh_dim)
    return 0, 1


def resolved_parallel_layout(model: PreTrainedModel, distributed_config) -> tuple[dict[str, str], int, int]:
    """`(tp_plan, tp_size, ep_size)` that transformers' `from_pretrained` applies for `distributed_config` (a
    `transformers.distributed.DistributedConfig`): the model's plan, or a `tp_plan` dict given there (transformers
    whose models resolve their plans, `_resolve_parallel_plans`, 5.24: merged into the model's plan, an empty dict
    meaning none; 5.17: in place of it); with expert parallelism the experts' rules are the EP plan's. transformers
    5.17 - 5.18 have no `ep_size`: there `enable_expert_parallel=True` applies the EP plan alone over the `tp_size`
    ranks."""
    tp_size = getattr(distributed_config, "tp_size", None) or 1
    ep_size = getattr(distributed_config, "ep_size", None) or 1
    plan = dict(getattr(model, "_tp_plan", None) or {})
    override = getattr(distributed_config, "tp_plan", None)
    if isinstance(override, dict):
        merges = hasattr(model, "_resolve_parallel_plans")
        plan = ({**plan, **override} if override else {}) if merges else dict(override)
    legacy_expert_parallel = getattr(distributed_config, "enable_expert_parallel", False) and \
        not hasattr(distributed_config, "ep_size")
    if legacy_expert_parallel:
        plan, ep_size = dict(getattr(model, "_ep_plan", None) or {}), tp_size
    elif ep_size > 1:
        plan = {key: style for key, style in plan.items() if ".mlp.experts" not in key}
    return plan, tp_size, ep_size


def check_parallel_sizes(config: LLaDA2MoeConfig, tp_plan: dict[str, str], tp_size: int, ep_size: int) -> None:
    """Refuse, before any weight loads or forward, a tensor- / expert-parallel layout the model cannot split.

    Args:
        config: the model's config.
        tp_plan (`dict[str, str]`): the rules in use (`resolved_parallel_layout`), e.g. the config's
            `base_model_tp_plan` plus the LM's `_tp_plan`.
        tp_size (`int`): tensor-parallel ranks; ep_size (`int`): expert-parallel ranks.

    Raises:
        ValueError: naming the config value and the rule: with `dense` sharded by rows (attention split by head
            group) `num_attention_heads` and `num_key_value_heads` must be multiples of `tp_size` (each rank computes
            whole heads and the K/V heads its q heads read); with the routed experts sharded (`packed_colwise`)
            `moe_intermediate_size` must be; with expert parallelism `num_experts` must be a multiple of `ep_size`.
    """
    rules = []
    if tp_size > 1 and plan_style(tp_plan, "layers.*.attention.dense") == "rowwise":
        rules += [("num_attention_heads", tp_size, "tensor-parallel size (each rank computes whole heads)"),
                  ("num_key_value_heads", tp_size, "tensor-parallel size (each rank keeps whole K/V heads)")]
    if tp_size > 1 and plan_style(tp_plan, "layers.*.mlp.experts.gate_up_proj") == "packed_colwise":
        rules.append(("moe_intermediate_size", tp_size, "tensor-parallel size (each rank keeps an equal slice of "
                                                        "every expert's gate and up projections)"))
    if ep_size > 1:
        rules.append(("num_experts", ep_size, "expert-parallel size (each rank keeps an equal number of experts)"))
    for name, size, what in rules:
        value = getattr(config, name)
        if value % size:
            divisors = [d for d in range(1, value + 1) if value % d == 0]
            raise ValueError(f"`{name}` (={value}) must be a multiple of the {what}, {size} here; launch a number "
                             f"of ranks that divides it (torchrun --nproc_per_node in {divisors}), or load the "
                             "model without tensor parallelism (`device_map=\"auto\"` splits it by layers).")


def additive_mask(attention_mask: torch.Tensor | None, dtype: torch.dtype, config, inputs_embeds, cache):
    """The 4D mask the attention adds: a float 4D mask as given, a bool 4D mask as 0 / dtype min, a 2D padding
    mask or None as bidirectional attention (transformers' `create_bidirectional_mask`)."""
    if attention_mask is not None and attention_mask.dim() == 4:
        if attention_mask.dtype == torch.bool:
            return torch.zeros(attention_mask.shape, dtype=dtype, device=attention_mask.device).masked_fill(
                ~attention_mask, torch.finfo(dtype).min)
        if attention_mask.dtype != dtype:       # e.g. an fp32 finfo.min would become -inf in bf16
            return attention_mask.to(dtype).clamp(min=torch.finfo(dtype).min)
        return attention_mask
    return create_bidirectional_mask(config=config, inputs_embeds=inputs_embeds, attention_mask=attention_mask,
                                     **cache_kwarg(cache))


class LLaDA2MoeModel(LLaDA2MoePreTrainedModel):
    """The LLaDA2 decoder stack (Hub `LLaDA2MoeModel`)."""

    def __init__(self, config: LLaDA2MoeConfig):
        super().__init__(config)
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)
        self.layers = nn.ModuleList([LLaDA2MoeDecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = Glm4MoeRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = Glm4MoeRotaryEmbedding(config=config)
        self.gradient_checkpointing = False
        self.post_init()

    def get_input_embeddings(self):
        """The token embedding, `word_embeddings`."""
        return self.word_embeddings

    def set_input_embeddings(self, value):
        """Replace the token embedding `word_embeddings` with `value`."""
        self.word_embeddings = value

    @accepts_cache_names
    def forward(self, input_ids: torch.LongTensor | None = None, attention_mask: torch.Tensor | None = None,
                position_ids: torch.LongTensor | None = None, cache: DynamicCache | None = None,
                inputs_embeds: torch.Tensor | None = None, use_cache: bool | None = None,
                **kwargs) -> MoeModelOutputWithPast:
        """Args as transformers' decoders; `attention_mask` `(N, 1, q, cache_len + q)` float (additive) or bool
        (True = attend), a 2D padding mask, or None (bidirectional). Returns the last hidden states `(N, q, H)`.
        The KV cache arrives as `cache` (transformers >= 5.24) or `past_key_values` (earlier versions).

        Raises:
            ValueError: unless exactly one of `input_ids` / `inputs_embeds` is given.
        """
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("LLaDA2MoeModel.forward: pass exactly one of `input_ids` and `inputs_embeds`.")
        if inputs_embeds is None:
            inputs_embeds = self.word_embeddings(input_ids)
        if use_cache and cache is None:
            cache = DynamicCache(config=self.config)
        if position_ids is None:
            past = cache.get_seq_length() if cache is not None else 0
            position_ids = (torch.arange(inputs_embeds.shape[1], device=inputs_embeds.device) + past)[None]
        mask = additive_mask(attention_mask, inputs_embeds.dtype, self.config, inputs_embeds, cache)
        hidden = inputs_embeds
        position_embeddings = self.rotary_emb(hidden, position_ids)
        for layer in self.layers:
            hidden = layer(hidden, attention_mask=mask, position_embeddings=position_embeddings,
                           cache=cache, **kwargs)
        return MoeModelOutputWithPast(last_hidden_state=self.norm(hidden), **cache_field(cache))


class LLaDA2MoeModelLM(MaskTokenFromFilesMixin, DllmGenerationMixin, LLaDA2MoePreTrainedModel):
    """LLaDA2.x LM (the Hub class name, not "...ForCausalLM"): logits in fp32, `generate(decoding_strategy=...)`.

    `generate(ids, max_new_tokens=...)` runs the family decoder (threshold decoding with LLaDA2.1 token editing,
    `decoding_strategy="llada2"`) with a KV cache; the Hub call `generate(inputs, gen_length=..., block_length=...,
    steps=..., threshold=..., editing_threshold=..., max_post_steps=..., eos_early_stop=..., eos_id=...,
    mask_id=..., temperature=..., top_p=..., top_k=...)` keeps working and returns, as the Hub, only the generated
    tokens up to the first EOS (see :func:`map_hub_generate_kwargs`). LLaDA2.0 and 2.1 share the `model_type`; a
    LLaDA2.0 checkpoint is not trained for editing: decode it with `preset="llada2.0"` (or store that choice with
    `LLaDA2DecodingConfig(...).save_to_generation_config(model.generation_config)`).

    >>> model = AutoModelForCausalLM.from_pretrained("inclusionAI/LLaDA2.1-mini", dtype=torch.bfloat16)  # doctest: +SKIP
    >>> out = model.generate(ids, gen_length=256, block_length=32, threshold=0.7, editing_threshold=0.5)  # doctest: +SKIP
    """

    _tied_weights_keys = {"lm_head.weight": "model.word_embeddings.weight"}
    _tp_plan = {"lm_head": "colwise_gather_output"}      # full logits on every rank (each rank decodes the same)
    # `lm_head` stays unquantized, also when `llm_int8_skip_modules` replaces transformers' default skips (see
    # `model_patches.sdar.SDARForCausalLM`). Anchored: "lm_head" would also be the float16 dtype plan and load the
    # (untied) head in float32 beside float16 hidden states; "lm_head$" names the module only.
    native_decoding_strategy = "llada2"
    _keep_in_fp32_modules = ["lm_head$"]
    hub_mask_token = MASK_TOKEN       # `from_pretrained` reads it from the tokenizer files (not in the Hub configs)

    def __init__(self, config: LLaDA2MoeConfig):
        super().__init__(config)
        self.model = LLaDA2MoeModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_output_embeddings(self):
        """The output head, `lm_head`."""
        return self.lm_head

    def set_output_embeddings(self, value):
        """Replace the output head `lm_head` with `value`."""
        self.lm_head = value

    @read_only_cache_keyword("store_kv", "LLaDA2 (S2D2's port)")
    @accepts_cache_names
    def forward(self, input_ids: torch.LongTensor | None = None, attention_mask: torch.Tensor | None = None,
                position_ids: torch.LongTensor | None = None, cache: DynamicCache | None = None,
                inputs_embeds: torch.Tensor | None = None, labels: torch.LongTensor | None = None,
                use_cache: bool | None = None, logits_to_keep: int = 0, **kwargs) -> CausalLMOutputWithPast:
        """`LLaDA2MoeModel.forward`, then the head on the last `logits_to_keep` rows (0 = all), in fp32;
        `store_kv=False` (S2D2's LLaDA2 port's keyword) leaves a given cache as it was.

        `labels` `(N, q)` gives the position-aligned cross-entropy (logits at i against token i, -100 ignored),
        the Hub's loss convention.
        """
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         cache=cache, inputs_embeds=inputs_embeds, use_cache=use_cache, **kwargs)
        hidden = out.last_hidden_state
        if logits_to_keep:
            hidden = hidden[:, -logits_to_keep:]
        logits = self.lm_head(hidden).float()
        loss = None
        if labels is not None:
            loss = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                               ignore_index=-100)
        return CausalLMOutputWithPast(loss=loss, logits=logits, **cache_field(output_cache(out)))

    def adjust_generation_fn(self, *args, **kwargs):
        """transformers' loading of the generation config, then the Hub `generate`'s stop id (`eos_id` 156892, the
        config's `eos_token_id`) where the checkpoint's files name none: the Hub config.json has no eos key
        (families.md §4.1), and without a generation_config.json the generation config transformers derives from
        that file had none, so decoding never stopped at EOS. A call's own `eos_token_id=None` still decodes on."""
        super().adjust_generation_fn(*args, **kwargs)
        if self.generation_config is not None and self.generation_config.eos_token_id is None:
            self.generation_config.eos_token_id = self.config.eos_token_id

    def generate(self, *args, **kwargs):
        """`DllmGenerationMixin.generate` with the Hub keywords mapped (see :func:`map_hub_generate_kwargs`)."""
        kwargs, hub_call = map_hub_generate_kwargs(kwargs)
        out = super().generate(*args, **kwargs)
        if not hub_call:
            return out
        prompt = args[0] if args else kwargs.get("inputs", kwargs.get("input_ids"))
        sequences = out if isinstance(out, torch.Tensor) else out.sequences
        # The stop ids decoding used: the call's, else the family's resolution (generation config, then config).
        eos = kwargs["eos_token_id"] if "eos_token_id" in kwargs else LLaDA2Patch().stop_token_ids(self, None)
        trimmed = hub_output(sequences, prompt.shape[1], eos, self.config.pad_token_id)
        if isinstance(out, torch.Tensor):
            return trimmed
        out.sequences = trimmed            # return_dict_in_generate=True: the statistics stay as computed
        return out


#: Hub `generate` keyword -> hf_dllm_spec parameter (`temperature`, `eos_early_stop`, `minimal_topk`: see
#: :func:`map_hub_generate_kwargs`).
HUB_GENERATE_KEYWORDS: dict[str, str] = {
    "gen_length": "max_new_tokens",
    "block_length": "block_size",
    "steps": "steps_per_block",
    "threshold": "confidence_threshold",
    "eos_id": "eos_token_id",
    "mask_id": "mask_token_id",
}


def map_hub_generate_kwargs(kwargs: dict[str, Any]) -> tuple[dict[str, Any], bool]:
    """Translate the Hub `LLaDA2MoeModelLM.generate` keywords (families.md §4.7) into this library's parameters.

    `gen_length` -> `max_new_tokens`, `block_length` -> `block_size`, `steps` -> `steps_per_block` (capped at
    `gen_length`, as the Hub caps it at `gen_length // minimal_topk`, then clamped to the block size) with LLaDA2.0
    decoding (`preset="llada2.0"` or `num_to_transfer=None`), else dropped, as the
    LLaDA2.1 loop ignores it, `threshold` -> `confidence_threshold`,
    `eos_id` -> `eos_token_id`, `mask_id` -> `mask_token_id`; `temperature=0` means greedy (`do_sample=False`,
    `top_p` / `top_k` dropped) and `temperature > 0` sampling; `editing_threshold`, `max_post_steps` and
    `num_to_transfer` are this library's names already. `eos_early_stop` is accepted: decoding always stops
    after the block holding EOS, which gives the Hub's output either way (the Hub truncates at the first EOS);
    `minimal_topk` (the Hub's cap `steps <= gen_length // minimal_topk`) only accepts 1.

    Returns:
        `(kwargs, hub_call)`: `hub_call` is True when `gen_length` was given; then `generate` returns what the
        Hub returns (the generated tokens only, cut after the first EOS; see :func:`hub_output`).

    Raises:
        ValueError: a negative `temperature`; `minimal_topk` other than 1; a Hub keyword together with the name
            it maps to (e.g. `threshold` and `confidence_threshold`).
    """
    out = dict(kwargs)
    hub_call = "gen_length" in out
    out.pop("eos_early_stop", None)
    if out.get("minimal_topk", 1) != 1:
        raise ValueError(f"`minimal_topk` (={out['minimal_topk']!r}) must be 1; the step count is `steps` "
                         "(`steps_per_block`), drop `minimal_topk`.")
    out.pop("minimal_topk", None)
    llada20 = out.get("preset") == "llada2.0" or ("num_to_transfer" in out and out["num_to_transfer"] is None)
    if not llada20:
        out.pop("steps", None)             # the LLaDA2.1 loop ignores `steps` (num_to_transfer decides)
    if llada20 and out.get("steps") is not None and out.get("gen_length") is not None:
        out["steps"] = min(int(out["steps"]), int(out["gen_length"]))        # the Hub's cap (minimal_topk=1)
    out = rename_hub_keywords(out, HUB_GENERATE_KEYWORDS)
    if out.get("steps_per_block") is not None and out.get("block_size") is not None:
        out["steps_per_block"] = min(int(out["steps_per_block"]), int(out["block_size"]))
    return hub_temperature(out), hub_call


def hub_output(sequences: torch.Tensor, prompt_length: int, eos_token_id, pad_token_id) -> torch.Tensor:
    """What the Hub `generate` returns: the generated part of `sequences` `(N, P + n)`, cut after the first EOS
    (inclusive); rows of a batch are right-padded with `pad_token_id` to the longest, `(N, n')`."""
    eos = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id or [])
    generated = sequences[:, prompt_length:]
    is_eos = torch.isin(generated, torch.tensor(eos, device=generated.device)) if eos else \
        torch.zeros_like(generated, dtype=torch.bool)
    after = (is_eos.long().cumsum(dim=1) - is_eos.long()) > 0             # strictly after the first EOS
    lengths = (~after).sum(dim=1)
    width = int(lengths.max()) if generated.shape[0] else 0
    pad = pad_token_id if pad_token_id is not None else (eos[0] if eos else 0)
    return generated[:, :width].masked_fill(after[:, :width], pad)


def _conversion_mapping() -> list:
    """Hub layout <-> this module: per-expert weights fused (as transformers' qwen2_moe mapping) and the router
    bias renamed; reversed by `save_pretrained`."""
    return [
        WeightConverter(source_patterns=["mlp.experts.*.gate_proj.weight", "mlp.experts.*.up_proj.weight"],
                        target_patterns="mlp.experts.gate_up_proj", operations=[MergeModulelist(dim=0), Concatenate(dim=1)]),
        WeightConverter(source_patterns="mlp.experts.*.down_proj.weight", target_patterns="mlp.experts.down_proj",
                        operations=[MergeModulelist(dim=0)]),
        WeightRenaming(r"\.mlp\.gate\.expert_bias", ".mlp.gate.e_score_correction_bias"),
    ]


def register_conversion_mapping() -> None:
    """Register the Hub-layout conversion for `model_type` "llada2_moe" with transformers (idempotent); done by
    `from_pretrained` / `save_pretrained` of the LLaDA2 classes, so importing this module registers nothing."""
    register_checkpoint_conversion_mapping(LLaDA2MoeConfig.model_type, _conversion_mapping(), overwrite=True)


class LLaDA2Patch(FamilyPatch):
    family = "LLaDA2"
    model_types = ("llada2_moe",)
    alignment = "position"
    native_strategy = "llada2"
    #: S2D2's LLaDA2 reference (`LLaDA2/generate_utils.py::generate_ssd_policy`) has no UCB policy. LLaDA2 lays
    #: out blocks as SDAR does (whole prompt blocks prefilled, the tail shares the first generated block), so
    #: the UCB progress follows the SDAR reference: only tokens decoded in the block count.
    ucb_progress_counts_prompt_tail = False
    auto_classes = ((LLaDA2MoeConfig, LLaDA2MoeModelLM),)
    base_model_classes = ((LLaDA2MoeConfig, LLaDA2MoeModel),)

    def attention_window(self, model) -> None:
        """None: LLaDA2's attention is full; the Hub config's `sliding_window` (kept for round trips) is never
        applied by its modeling or this one."""
        return None

    def mask_token_id(self, model: PreTrainedModel, override: int | None = None) -> int | None:
        """`override`, `config.mask_token_id` or `generation_config.mask_token_id`; else, for a model with the
        Hub vocabulary, the Hub id 156895 with a warning (the Hub configs carry no mask id)."""
        found = super().mask_token_id(model, override)
        if found is None and self.vocab_size(model) > HUB_MASK_TOKEN_ID:
            logger.warning("LLaDA2: no mask token id in the config or the tokenizer files; using the Hub id %d. "
                           "Pass mask_token_id=... to generate to choose another.", HUB_MASK_TOKEN_ID)
            return HUB_MASK_TOKEN_ID
        return found

    def trained_block_size(self, model: PreTrainedModel) -> int | None:
        """`config.block_size` if set, else 32 (every LLaDA2.x checkpoint; the Hub configs do not state it)."""
        return super().trained_block_size(model) or HUB_BLOCK_SIZE


__all__ = ["HUB_EOS_TOKEN_ID", "HUB_MASK_TOKEN_ID", "LLaDA2MoeConfig", "LLaDA2MoeModel", "LLaDA2MoeModelLM",
           "LLaDA2Patch", "check_parallel_sizes"]
