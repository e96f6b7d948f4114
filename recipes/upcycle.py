"""Function-preserving conversion of a trained SDAR model into a LLaDA2 MoE ("sparse upcycling", Komatsuzaki et al.
2022, arXiv 2212.05055, with the dense MLP split into expert slices instead of copied).

Attention maps one to one (q/k/v projections fused into `query_key_value` as [q | k | v] by heads, `q_norm` /
`k_norm` -> `query_layernorm` / `key_layernorm`, `o_proj` -> `dense`; RoPE on the whole head,
`partial_rotary_factor` 1.0, as the source). Layers before `first_k_dense_replace` keep their dense MLP. In an MoE
layer the dense MLP's I neurons are split: the first `num_shared_experts * moe_intermediate_size` become the shared
expert, the rest `S` slices of `moe_intermediate_size`; the experts of each of the two groups are the S slices
(expert e and e + S are copies), `num_experts_per_tok` = S and `topk_group` = 1. With a zero router every expert
scores sigmoid(0) = 1/2, the first group wins the tie and all S slices are chosen with weight
`routed_scaling_factor` / S each, so scaling each slice's down projection by S / `routed_scaling_factor` makes the
MoE compute exactly the dense MLP: the converted model's logits equal the source's (tested). Training then breaks
the router's ties and specialises the experts (`python -m recipes.train --objective llada2
--init-from <SDAR checkpoint>`).
"""

from __future__ import annotations

import torch


@torch.no_grad()
def sdar_to_llada2(sdar, *, moe_intermediate_size: int, num_shared_experts: int, first_k_dense_replace: int = 1,
                   routed_scaling_factor: float = 2.5):
    """A `LLaDA2MoeModelLM` computing the same logits as `sdar` (an `SDARForCausalLM`); its router starts at zero.

    Args:
        moe_intermediate_size (`int`): neurons per expert; the source's `intermediate_size` minus the shared part
            must be a positive multiple of it.
        num_shared_experts (`int`): the shared expert takes `num_shared_experts * moe_intermediate_size` neurons.

    Raises:
        ValueError: if the neurons do not split into slices, or the source is not an SDAR model.
    """
    from model_patches.llada2 import LLaDA2MoeConfig, LLaDA2MoeModelLM

    cfg = sdar.config
    if cfg.model_type != "sdar":
        raise ValueError(f"sdar_to_llada2: the source's model_type (={cfg.model_type!r}) must be 'sdar'; pass an "
                         "SDAR checkpoint as --init-from.")
    shared = num_shared_experts * moe_intermediate_size
    slices, rest = divmod(cfg.intermediate_size - shared, moe_intermediate_size)
    if slices < 1 or rest:
        raise ValueError(f"sdar_to_llada2: intermediate_size {cfg.intermediate_size} minus the shared {shared} "
                         f"neurons must be a positive multiple of moe_intermediate_size (={moe_intermediate_size}).")
    config = LLaDA2MoeConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers, num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim, rms_norm_eps=cfg.rms_norm_eps,
        max_position_embeddings=cfg.max_position_embeddings, rope_theta=cfg.rope_parameters["rope_theta"],
        partial_rotary_factor=1.0, num_experts=2 * slices, num_experts_per_tok=slices, n_group=2, topk_group=1,
        num_shared_experts=num_shared_experts, moe_intermediate_size=moe_intermediate_size,
        first_k_dense_replace=first_k_dense_replace, routed_scaling_factor=routed_scaling_factor,
        tie_word_embeddings=False, pad_token_id=cfg.pad_token_id, eos_token_id=cfg.eos_token_id,
        mask_token_id=cfg.mask_token_id, initializer_range=cfg.initializer_range,
        attn_implementation=cfg._attn_implementation)
    model = LLaDA2MoeModelLM(config).to(sdar.dtype)
    model.model.word_embeddings.weight.copy_(sdar.model.embed_tokens.weight)
    model.lm_head.weight.copy_(sdar.lm_head.weight)
    model.model.norm.weight.copy_(sdar.model.norm.weight)
    for src, dst in zip(sdar.model.layers, model.model.layers):
        a, att = src.self_attn, dst.attention
        att.query_key_value.weight.copy_(torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]))
        att.query_layernorm.weight.copy_(a.q_norm.weight)
        att.key_layernorm.weight.copy_(a.k_norm.weight)
        att.dense.weight.copy_(a.o_proj.weight)
        dst.input_layernorm.weight.copy_(src.input_layernorm.weight)
        dst.post_attention_layernorm.weight.copy_(src.post_attention_layernorm.weight)
        mlp = src.mlp
        if not hasattr(dst.mlp, "experts"):                                  # a dense layer
            for name in ("gate_proj", "up_proj", "down_proj"):
                getattr(dst.mlp, name).weight.copy_(getattr(mlp, name).weight)
            continue
        moe = dst.mlp
        for name in ("gate_proj", "up_proj"):
            getattr(moe.shared_experts, name).weight.copy_(getattr(mlp, name).weight[:shared])
        moe.shared_experts.down_proj.weight.copy_(mlp.down_proj.weight[:, :shared])
        scale = slices / routed_scaling_factor
        for e in range(2 * slices):
            lo = shared + (e % slices) * moe_intermediate_size
            hi = lo + moe_intermediate_size
            moe.experts.gate_up_proj[e].copy_(torch.cat([mlp.gate_proj.weight[lo:hi], mlp.up_proj.weight[lo:hi]]))
            moe.experts.down_proj[e].copy_(mlp.down_proj.weight[:, lo:hi] * scale)
        moe.gate.weight.zero_()
        moe.gate.e_score_correction_bias.zero_()
    return model
