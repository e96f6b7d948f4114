"""LLaDA2.x (`model_patches/llada2.py`) against an independent plain-torch reference over the Hub state dict.

The reference below reads only the Hub-layout tensors (`model.safetensors` as `save_pretrained` writes it) and the
config numbers, and implements families.md §4 directly: fused QKV split [q | k | v] by heads, q/k RMSNorm over
head_dim, partial rotate-half RoPE, GQA, `dense`, dense SwiGLU layer 0, then the group-limited sigmoid MoE with
`expert_bias` for the choice only and the shared expert, final norm, `lm_head`. It runs in float64 with plain
loops over tokens and experts.
"""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, DynamicCache
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
from transformers.utils.import_utils import is_torch_greater_or_equal

import hf_dllm_spec
from hf_dllm_spec.maths.masks import block_causal_mask, causal_mask, to_additive, verifier_2l_mask
from model_patches.compat import output_cache
from model_patches.llada2 import LLaDA2MoeConfig, LLaDA2MoeModelLM

MASK_ID = 98
BLOCK = 4
TINY_LLADA2 = dict(vocab_size=99, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=8, num_experts=8, num_experts_per_tok=2, num_shared_experts=1,
                   moe_intermediate_size=16, n_group=2, topk_group=1, routed_scaling_factor=2.5,
                   max_position_embeddings=256, rope_theta=10000.0, partial_rotary_factor=0.5, mask_token_id=MASK_ID,
                   pad_token_id=None, eos_token_id=None, initializer_range=0.2, attn_implementation="sdpa")
TOL = 1e-4


# ----------------------------------------------------------------------------------------------------------------
# fixtures


@pytest.fixture(scope="module")
def model() -> LLaDA2MoeModelLM:
    """Tiny random LLaDA2 (layer 0 dense, layers 1-2 MoE), fp32. The norm weights are randomised (so q/k norm,
    input / post-attention norms cannot be confused) and the router's `expert_bias` is random and non-zero."""
    torch.manual_seed(0)
    m = LLaDA2MoeModelLM(LLaDA2MoeConfig(**TINY_LLADA2)).eval()
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith("layernorm.weight") or name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
        for layer in m.model.layers[m.config.first_k_dense_replace:]:
            layer.mlp.gate.e_score_correction_bias.normal_(0.0, 0.3)
    return m


@pytest.fixture(scope="module")
def saved_dir(model, tmp_path_factory):
    path = tmp_path_factory.mktemp("llada2_saved")
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def hub_state(saved_dir) -> dict[str, torch.Tensor]:
    """The Hub-layout state dict, as written by `save_pretrained`."""
    return load_file(str(saved_dir / "model.safetensors"))


def hub_names(cfg) -> set[str]:
    """Every tensor name of a LLaDA2 Hub checkpoint (families.md §4.2)."""
    names = {"model.word_embeddings.weight", "model.norm.weight", "lm_head.weight"}
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        names |= {p + n for n in ("input_layernorm.weight", "post_attention_layernorm.weight",
                                  "attention.query_key_value.weight", "attention.query_layernorm.weight",
                                  "attention.key_layernorm.weight", "attention.dense.weight")}
        if i < cfg.first_k_dense_replace:
            names |= {p + f"mlp.{n}_proj.weight" for n in ("gate", "up", "down")}
        else:
            names |= {p + "mlp.gate.weight", p + "mlp.gate.expert_bias"}
            names |= {p + f"mlp.shared_experts.{n}_proj.weight" for n in ("gate", "up", "down")}
            names |= {p + f"mlp.experts.{e}.{n}_proj.weight" for e in range(cfg.num_experts)
                      for n in ("gate", "up", "down")}
    return names


# ----------------------------------------------------------------------------------------------------------------
# the reference


def _rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope(x, pos, rotary_dim, theta):
    """Rotate-half RoPE on the first `rotary_dim` dims of `x` `(T, head_dim)`; the rest pass through."""
    inv_freq = 1.0 / theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)
    freqs = pos.double()[:, None] * inv_freq[None]
    emb = torch.cat([freqs, freqs], dim=-1)
    rot, rest = x[:, :rotary_dim], x[:, rotary_dim:]
    half = rotary_dim // 2
    rotated = torch.cat([-rot[:, half:], rot[:, :half]], dim=-1)
    return torch.cat([rot * emb.cos() + rotated * emb.sin(), rest], dim=-1)


def _swiglu(x, gate, up, down):
    return (torch.nn.functional.silu(x @ gate.T) * (x @ up.T)) @ down.T


def reference_route(scores, bias, n_group, topk_group, top_k, scaling):
    """One token: `scores` (E,) unbiased sigmoid scores -> (chosen experts sorted by id, their weights)."""
    per_group = scores.shape[0] // n_group
    biased = scores + bias
    group_score = [sorted(biased[g * per_group:(g + 1) * per_group].tolist(), reverse=True)[:2] for g in
                   range(n_group)]
    group_score = [sum(s) for s in group_score]
    kept = sorted(range(n_group), key=lambda g: -group_score[g])[:topk_group]
    candidates = [e for e in range(scores.shape[0]) if e // per_group in kept]
    chosen = sorted(sorted(candidates, key=lambda e: -float(biased[e]))[:top_k])
    w = scores[chosen]
    return chosen, w / (w.sum() + 1e-20) * scaling


def _as_additive(mask):
    mask = mask.double() if mask.dtype != torch.bool else torch.zeros(mask.shape, dtype=torch.float64).masked_fill(
        ~mask, -math.inf)
    return mask


def reference_logits(sd, cfg, input_ids, position_ids, mask, prefix_ids=None, prefix_positions=None,
                     prefix_mask=None):
    """LLaDA2 logits of `input_ids` `(N, q)` from the Hub state dict, float64.

    `mask` `(N, 1, q, P + q)` (bool True = attend, or additive) over [cached prefix | query]; the prefix tokens
    `(N, P)` (optional) are run first under `prefix_mask` `(N, 1, P, P)` and never see the query, as when they
    are prefilled into a cache. Returns `(N, q, V)`.
    """
    sd = {k: v.double() for k, v in sd.items()}
    n_q, n_kv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    eps, rotary_dim = cfg.rms_norm_eps, int(hd * cfg.partial_rotary_factor)
    mask = _as_additive(mask)
    if prefix_ids is not None:
        p = prefix_ids.shape[1]
        n, q = input_ids.shape
        top = torch.cat([_as_additive(prefix_mask), torch.full((n, 1, p, q), -math.inf, dtype=torch.float64)], -1)
        mask = torch.cat([top, mask], dim=2)
        input_ids = torch.cat([prefix_ids, input_ids], dim=1)
        position_ids = torch.cat([prefix_positions, position_ids], dim=1)
    else:
        p = 0
    out = []
    for n in range(input_ids.shape[0]):
        ids, pos, add = input_ids[n], position_ids[n], mask[n, 0]
        t = ids.shape[0]
        h = sd["model.word_embeddings.weight"][ids]
        for i in range(cfg.num_hidden_layers):
            pre = f"model.layers.{i}."
            x = _rms(h, sd[pre + "input_layernorm.weight"], eps)
            qkv = x @ sd[pre + "attention.query_key_value.weight"].T
            q = qkv[:, :n_q * hd].reshape(t, n_q, hd)
            k = qkv[:, n_q * hd:(n_q + n_kv) * hd].reshape(t, n_kv, hd)
            v = qkv[:, (n_q + n_kv) * hd:].reshape(t, n_kv, hd)
            q = _rms(q, sd[pre + "attention.query_layernorm.weight"], eps)
            k = _rms(k, sd[pre + "attention.key_layernorm.weight"], eps)
            heads = []
            for head in range(n_q):
                g = head // (n_q // n_kv)
                qh, kh = _rope(q[:, head], pos, rotary_dim, cfg.rope_theta), _rope(k[:, g], pos, rotary_dim,
                                                                                    cfg.rope_theta)
                att = torch.softmax(qh @ kh.T * hd ** -0.5 + add, dim=-1)
                heads.append(att @ v[:, g])
            h = h + torch.cat(heads, dim=-1) @ sd[pre + "attention.dense.weight"].T
            x = _rms(h, sd[pre + "post_attention_layernorm.weight"], eps)
            if i < cfg.first_k_dense_replace:
                mlp = _swiglu(x, *(sd[pre + f"mlp.{w}_proj.weight"] for w in ("gate", "up", "down")))
            else:
                mlp = torch.zeros_like(x)
                for tok in range(t):
                    xt = x[tok:tok + 1]
                    scores = torch.sigmoid(xt[0] @ sd[pre + "mlp.gate.weight"].T)
                    chosen, weights = reference_route(scores, sd[pre + "mlp.gate.expert_bias"], cfg.n_group,
                                                      cfg.topk_group, cfg.num_experts_per_tok,
                                                      cfg.routed_scaling_factor)
                    acc = _swiglu(xt, *(sd[pre + f"mlp.shared_experts.{w}_proj.weight"] for w in ("gate", "up",
                                                                                                   "down")))
                    for e, w_e in zip(chosen, weights):
                        acc = acc + w_e * _swiglu(xt, *(sd[pre + f"mlp.experts.{e}.{w}_proj.weight"]
                                                        for w in ("gate", "up", "down")))
                    mlp[tok] = acc[0]
            h = h + mlp
        h = _rms(h, sd["model.norm.weight"], eps)
        out.append((h @ sd["lm_head.weight"].T)[p:])
    return torch.stack(out)


def _ids(n, t, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, MASK_ID, (n, t), generator=g)


def _max_diff(a, b):
    return (a.double() - b.double()).abs().max().item()


# ----------------------------------------------------------------------------------------------------------------
# 1. logits against the reference


def test_saved_keys_are_exactly_the_hub_names(model, hub_state):
    assert set(hub_state) == hub_names(model.config)
    assert not any("gate_up_proj" in k or "e_score_correction_bias" in k for k in hub_state)
    # the router bias is saved with its values (random and non-zero here)
    torch.testing.assert_close(hub_state["model.layers.1.mlp.gate.expert_bias"],
                               model.model.layers[1].mlp.gate.e_score_correction_bias, rtol=0, atol=0)
    assert hub_state["model.layers.1.mlp.gate.expert_bias"].abs().min() > 0


def test_expert_bias_changes_the_choice(model):
    """Without this the reference comparisons could not see a router that ignores `expert_bias`."""
    gate = model.model.layers[1].mlp.gate
    unbiased = copy.deepcopy(gate)
    unbiased.e_score_correction_bias.zero_()
    h = torch.randn(64, model.config.hidden_size, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        chosen = gate(h)[2].sort(dim=-1).values
        chosen0 = unbiased(h)[2].sort(dim=-1).values
    assert (chosen != chosen0).any(dim=-1).float().mean() > 0.2


@pytest.mark.parametrize("top_k,norm", [(1, True), (2, False)])
def test_router_normalises_iff_top_k_above_one(top_k, norm):
    """The Hub gate never reads `norm_topk_prob`: it normalises the top-k weights iff top-k > 1 (before: the GLM
    router followed the key, so top-1 gave 2.5 for every token and `norm_topk_prob=False` left top-2 unnormalised)."""
    from model_patches.llada2 import LLaDA2MoeTopkRouter

    torch.manual_seed(0)
    config = LLaDA2MoeConfig(**{**TINY_LLADA2, "num_experts_per_tok": top_k, "norm_topk_prob": norm})
    gate = LLaDA2MoeTopkRouter(config)
    with torch.no_grad():
        gate.weight.normal_(0.0, 0.5)
        h = torch.randn(16, config.hidden_size, generator=torch.Generator().manual_seed(1))
        _, weights, experts = gate(h)
        scores = torch.sigmoid(h @ gate.weight.T)                                   # (16, E)
    chosen = scores.gather(1, experts)
    expected = chosen / (chosen.sum(dim=-1, keepdim=True) + 1e-20) if top_k > 1 else chosen
    torch.testing.assert_close(weights, expected * config.routed_scaling_factor)


def test_block_causal_full_sequence_matches_reference(model, hub_state):
    n, t = 2, 11
    ids = _ids(n, t, 0)
    ids[0, 8:] = MASK_ID                                     # a denoising block with masks
    positions = torch.arange(t)[None] + torch.tensor([[0], [2]])  # row 1 offset: different block boundaries
    mask = block_causal_mask(positions, BLOCK)                # (N, t, t) bool
    with torch.no_grad():
        got = model(ids, attention_mask=to_additive(mask, torch.float32), position_ids=positions).logits
    want = reference_logits(hub_state, model.config, ids, positions, mask[:, None])
    assert got.dtype == torch.float32
    assert _max_diff(got, want) <= TOL
    # the mask matters: a bidirectional forward gives different logits on the early blocks
    with torch.no_grad():
        full = model(ids, position_ids=positions).logits
    assert _max_diff(full[:, :4], got[:, :4]) > 1e-2


def test_causal_matches_reference(model, hub_state):
    n, t = 2, 9
    ids = _ids(n, t, 1)
    positions = torch.arange(t)[None].expand(n, t)
    mask = causal_mask(t)[None].expand(n, t, t)
    with torch.no_grad():
        got = model(ids, attention_mask=to_additive(mask, torch.float32), position_ids=positions).logits
    assert _max_diff(got, reference_logits(hub_state, model.config, ids, positions, mask[:, None])) <= TOL


def _prefill(model, prefix, prefix_pos, prefix_mask):
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        out = model(prefix, attention_mask=to_additive(prefix_mask, torch.float32), position_ids=prefix_pos,
                    cache=cache, use_cache=True)
    assert output_cache(out) is cache and cache.get_seq_length() == prefix.shape[1]
    return cache, out.logits


def _verifier_case(n=2, p=2 * BLOCK, b=BLOCK):
    """Prefix of `p` tokens (block-causal), query [block with drafts | MASK x b] at the block positions twice."""
    prefix = _ids(n, p, 2)
    prefix_pos = torch.arange(p)[None].expand(n, p)
    prefix_mask = block_causal_mask(prefix_pos, BLOCK)
    drafts = _ids(n, b, 3)
    query = torch.cat([drafts, torch.full((n, b), MASK_ID)], dim=1)
    block_pos = torch.arange(p, p + b)[None].expand(n, b)
    query_pos = torch.cat([block_pos, block_pos], dim=1)
    query_mask = torch.cat([torch.ones(2 * b, p, dtype=torch.bool), verifier_2l_mask(b)], dim=1)
    return prefix, prefix_pos, prefix_mask, query, query_pos, query_mask[None].expand(n, 2 * b, p + 2 * b)


def test_s2d2_verifier_layout_with_cache_matches_reference(model, hub_state):
    prefix, prefix_pos, prefix_mask, query, query_pos, query_mask = _verifier_case()
    cache, prefix_logits = _prefill(model, prefix, prefix_pos, prefix_mask)
    with torch.no_grad():
        got = model(query, attention_mask=to_additive(query_mask, torch.float32), position_ids=query_pos,
                    cache=cache).logits
    want = reference_logits(hub_state, model.config, query, query_pos, query_mask[:, None], prefix_ids=prefix,
                            prefix_positions=prefix_pos, prefix_mask=prefix_mask[:, None])
    assert _max_diff(got, want) <= TOL
    assert _max_diff(prefix_logits, reference_logits(hub_state, model.config, prefix, prefix_pos,
                                                     prefix_mask[:, None])) <= TOL
    # Eq. 3 meaning: MASK row i is the AR prediction for position p+i given prefix + drafts[:i]
    b, p = BLOCK, prefix.shape[1]
    for i in range(b):
        ar_query = torch.cat([query[:, :i], torch.full((query.shape[0], 1), MASK_ID)], dim=1)
        ar_pos = torch.arange(p, p + i + 1)[None].expand(query.shape[0], i + 1)
        ar_mask = torch.cat([torch.ones(i + 1, p, dtype=torch.bool), causal_mask(i + 1)], dim=1)
        ar_mask = ar_mask[None].expand(query.shape[0], i + 1, p + i + 1)
        ar = reference_logits(hub_state, model.config, ar_query, ar_pos, ar_mask[:, None], prefix_ids=prefix,
                              prefix_positions=prefix_pos, prefix_mask=prefix_mask[:, None])
        assert _max_diff(got[:, b + i], ar[:, -1]) <= TOL


def _denoise_case(n=2, p=2 * BLOCK + 2):
    """A prefix ending inside a block (prompt tail shares the first generation block), then that block's
    denoising query: the block tail with masks, seeing the prefix and the whole block (block-causal)."""
    prefix = _ids(n, p, 4)
    prefix_pos = torch.arange(p)[None].expand(n, p)
    prefix_mask = block_causal_mask(prefix_pos, BLOCK)
    q = 3 * BLOCK - p + BLOCK                                 # rest of the current block and one more block
    query = _ids(n, q, 5)
    query[0, 1:] = MASK_ID
    query[1, ::2] = MASK_ID
    query_pos = torch.arange(p, p + q)[None].expand(n, q)
    full_pos = torch.arange(p + q)[None].expand(n, p + q)
    query_mask = block_causal_mask(full_pos, BLOCK)[:, p:]
    return prefix, prefix_pos, prefix_mask, query, query_pos, query_mask


@pytest.mark.parametrize("case", [_verifier_case, _denoise_case], ids=["s2d2_2l", "block_denoise"])
def test_cache_and_no_cache_agree_and_logits_to_keep(model, hub_state, case):
    prefix, prefix_pos, prefix_mask, query, query_pos, query_mask = case()
    n, p, q = prefix.shape[0], prefix.shape[1], query.shape[1]
    cache, _ = _prefill(model, prefix, prefix_pos, prefix_mask)
    with torch.no_grad():
        cached = model(query, attention_mask=to_additive(query_mask, torch.float32), position_ids=query_pos,
                       cache=cache).logits
    full_mask = torch.cat([torch.cat([prefix_mask, torch.zeros(n, p, q, dtype=torch.bool)], dim=2), query_mask], 1)
    with torch.no_grad():
        whole = model(torch.cat([prefix, query], 1), attention_mask=to_additive(full_mask, torch.float32),
                      position_ids=torch.cat([prefix_pos, query_pos], 1)).logits
    assert whole.shape == (n, p + q, model.config.vocab_size)
    assert _max_diff(cached, whole[:, p:]) <= TOL
    want = reference_logits(hub_state, model.config, query, query_pos, query_mask[:, None], prefix_ids=prefix,
                            prefix_positions=prefix_pos, prefix_mask=prefix_mask[:, None])
    assert _max_diff(cached, want) <= TOL
    # logits_to_keep: the head on the last k rows only, same numbers
    for keep in (1, 3):
        with torch.no_grad():
            kept = model(torch.cat([prefix, query], 1), attention_mask=to_additive(full_mask, torch.float32),
                         position_ids=torch.cat([prefix_pos, query_pos], 1), logits_to_keep=keep).logits
        assert kept.shape == (n, keep, model.config.vocab_size)
        assert _max_diff(kept, whole[:, -keep:]) <= 1e-6


# ----------------------------------------------------------------------------------------------------------------
# 2. router


def _hand_router(model, probs_per_token, bias):
    """A copy of layer 1's router whose token t (hidden state e_t) has sigmoid scores `probs_per_token[t]`."""
    gate = copy.deepcopy(model.model.layers[1].mlp.gate)
    probs = torch.tensor(probs_per_token, dtype=torch.float64)
    with torch.no_grad():
        gate.weight.zero_()
        gate.weight[:, :probs.shape[0]] = torch.logit(probs).T.float()
        gate.e_score_correction_bias.copy_(torch.tensor(bias))
    hidden = torch.eye(model.config.hidden_size)[:probs.shape[0]]
    return gate, hidden


P0 = [0.9, 0.8, 0.1, 0.2, 0.6, 0.7, 0.5, 0.3]       # group 0 top-2 sum 1.7, group 1 top-2 sum 1.3
P1 = [0.3, 0.4, 0.2, 0.1, 0.5, 0.9, 0.6, 0.2]       # group 0 top-2 sum 0.7, group 1 top-2 sum 1.5


@pytest.mark.parametrize("bias, expected", [
    # no bias: P0 keeps group 0 -> experts 0, 1; P1 keeps group 1 -> experts 5, 6
    ([0.0] * 8, [([0, 1], [0.9 / 1.7, 0.8 / 1.7]), ([5, 6], [0.9 / 1.5, 0.6 / 1.5])]),
    # bias +0.5 on experts 4, 5: P0's group 1 scores 1.1 + 1.2 = 2.3 > 1.7 -> experts 4, 5 with the UNBIASED
    # 0.6, 0.7; P1 stays in group 1 but expert 4 (biased 1.0) beats expert 6 (0.6)
    ([0.0, 0.0, 0.0, 0.0, 0.5, 0.5, 0.0, 0.0], [([4, 5], [0.6 / 1.3, 0.7 / 1.3]), ([4, 5], [0.5 / 1.4, 0.9 / 1.4])]),
    # bias +0.75 on expert 2 (unbiased 0.1): P0 keeps group 0 and picks experts 0, 2 -> weights 0.9 / 1.0, 0.1 / 1.0;
    # P1: group 0 biased top-2 = 0.95 + 0.4 = 1.35 < 1.5, unchanged
    ([0.0, 0.0, 0.75, 0.0, 0.0, 0.0, 0.0, 0.0], [([0, 2], [0.9, 0.1]), ([5, 6], [0.9 / 1.5, 0.6 / 1.5])]),
    # negative bias -0.5 on expert 5: P1 group 1 biased [0.5, 0.4, 0.6, 0.2] sums 1.1 > 0.7, experts 4, 6
    ([0.0, 0.0, 0.0, 0.0, 0.0, -0.5, 0.0, 0.0], [([0, 1], [0.9 / 1.7, 0.8 / 1.7]), ([4, 6], [0.5 / 1.1, 0.6 / 1.1])]),
], ids=["no_bias", "bias_moves_group", "bias_moves_expert", "negative_bias"])
def test_router_hand_computed(model, bias, expected):
    gate, hidden = _hand_router(model, [P0, P1], bias)
    with torch.no_grad():
        logits, weights, indices = gate(hidden)
    torch.testing.assert_close(logits, torch.logit(torch.tensor([P0, P1])), atol=1e-5, rtol=0)
    order = indices.sort(dim=-1)
    weights = weights.gather(1, order.indices)
    assert order.values.tolist() == [e for e, _ in expected]
    want = torch.tensor([w for _, w in expected]) * 2.5
    torch.testing.assert_close(weights, want, atol=1e-5, rtol=0)
    # the reference rule gives the same
    for t, probs in enumerate([P0, P1]):
        chosen, w = reference_route(torch.tensor(probs, dtype=torch.float64), torch.tensor(bias, dtype=torch.float64),
                                    2, 1, 2, 2.5)
        assert chosen == expected[t][0]
        torch.testing.assert_close(w, torch.tensor(expected[t][1], dtype=torch.float64) * 2.5, atol=1e-9, rtol=0)


# ----------------------------------------------------------------------------------------------------------------
# 3. loading the Hub layout


AUTO_MAP = {"AutoConfig": "configuration_llada2_moe.LLaDA2MoeConfig",
            "AutoModel": "modeling_llada2_moe.LLaDA2MoeModel",
            "AutoModelForCausalLM": "modeling_llada2_moe.LLaDA2MoeModelLM"}


@pytest.fixture(scope="module")
def hub_dir(model, saved_dir, hub_state, tmp_path_factory):
    """A directory shaped like a Hub LLaDA2 repo: Hub-named safetensors, a config without `use_qk_norm` (and
    without transformers 5's `rope_parameters`), with the remote-code `auto_map` and Hub-only keys."""
    path = tmp_path_factory.mktemp("llada2_hub")
    save_file({k: v.contiguous() for k, v in hub_state.items()}, str(path / "model.safetensors"),
              metadata={"format": "pt"})
    config = json.loads((saved_dir / "config.json").read_text())
    for key in ("use_qk_norm", "rope_parameters", "transformers_version", "dtype", "mask_token_id"):
        config.pop(key, None)
    config.update(auto_map=AUTO_MAP, torch_dtype="float32", score_function="sigmoid",
                  moe_router_enable_expert_bias=True, router_dtype="fp32", rotary_dim=4, use_rmsnorm=True,
                  norm_head=False, rope_scaling=None, architectures=["LLaDA2MoeModelLM"])
    (path / "config.json").write_text(json.dumps(config))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"added_tokens_decoder": {str(MASK_ID): {"content": "<|mask|>", "special": True}}}))
    return path


def test_hub_layout_loads_with_auto_class(model, hub_dir, tmp_path):
    hf_dllm_spec.register_auto_classes()
    assert "use_qk_norm" not in json.loads((hub_dir / "config.json").read_text())
    loaded = AutoModelForCausalLM.from_pretrained(hub_dir).eval()
    assert type(loaded) is LLaDA2MoeModelLM
    assert loaded.config.use_qk_norm is True
    assert getattr(loaded.config, "auto_map", None) is None
    assert loaded.config.mask_token_id == MASK_ID                  # from the tokenizer files
    assert loaded.config.rope_parameters["partial_rotary_factor"] == 0.5
    for a, b in zip(loaded.model.layers[1:], model.model.layers[1:]):
        assert torch.equal(a.mlp.gate.e_score_correction_bias, b.mlp.gate.e_score_correction_bias)
        assert torch.equal(a.mlp.experts.gate_up_proj, b.mlp.experts.gate_up_proj)
    ids = _ids(2, 10, 6)
    mask = to_additive(block_causal_mask(torch.arange(10)[None].expand(2, 10), BLOCK), torch.float32)
    with torch.no_grad():
        want = model(ids, attention_mask=mask).logits
        got = loaded(ids, attention_mask=mask).logits
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
    # save -> load round trip: Hub names again, no auto_map written, identical logits
    loaded.save_pretrained(tmp_path)
    assert set(load_file(str(tmp_path / "model.safetensors"))) == hub_names(model.config)
    assert "auto_map" not in json.loads((tmp_path / "config.json").read_text())
    again = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        assert torch.equal(again(ids, attention_mask=mask).logits, got)


# ----------------------------------------------------------------------------------------------------------------
# 4. bf16 and bool masks


def test_bool_mask_equals_additive_mask(model):
    ids = _ids(2, 10, 7)
    positions = torch.arange(10)[None].expand(2, 10)
    mask = block_causal_mask(positions, BLOCK)
    with torch.no_grad():
        from_bool = model(ids, attention_mask=mask[:, None], position_ids=positions).logits
        additive = model(ids, attention_mask=to_additive(mask, torch.float32), position_ids=positions).logits
    torch.testing.assert_close(from_bool, additive, atol=1e-6, rtol=0)
    # eager attention (where transformers itself would mishandle a bool 4D mask) gives the same numbers
    eager = copy.deepcopy(model)
    eager.set_attn_implementation("eager")
    assert eager.config._attn_implementation == "eager"
    with torch.no_grad():
        from_bool_eager = eager(ids, attention_mask=mask[:, None], position_ids=positions).logits
    assert _max_diff(from_bool_eager, additive) <= 1e-5


def test_bf16_forward_with_bool_mask(model, saved_dir):
    bf16 = LLaDA2MoeModelLM.from_pretrained(saved_dir, dtype=torch.bfloat16).eval()
    assert bf16.model.word_embeddings.weight.dtype == torch.bfloat16
    assert bf16.model.layers[1].mlp.gate.e_score_correction_bias.dtype == torch.float32   # kept in fp32
    ids = _ids(2, 16, 8)
    positions = torch.arange(16)[None].expand(2, 16)
    mask = block_causal_mask(positions, BLOCK)[:, None]
    with torch.no_grad():
        low = bf16(ids, attention_mask=mask, position_ids=positions).logits
        high = model(ids, attention_mask=mask, position_ids=positions).logits
    assert low.dtype == torch.float32
    assert torch.isfinite(low).all()
    agree = (low.argmax(-1) == high.argmax(-1)).float().mean().item()
    assert agree >= 0.8, agree
    assert _max_diff(low, high) <= 0.1 * high.abs().max().item()
    # the cast checkpoint also matches the cast model (from_pretrained vs .to)
    cast = copy.deepcopy(model).to(torch.bfloat16)
    with torch.no_grad():
        low_cast = cast(ids, attention_mask=mask, position_ids=positions).logits
    assert (low_cast.argmax(-1) == high.argmax(-1)).float().mean().item() >= 0.8


# ----------------------------------------------------------------------------------------------------------------
# 5. no host synchronisation in the MoE forward


def _forbid_host_sync(mp):
    def forbidden(name):
        def fail(*args, **kwargs):
            raise AssertionError(f"host synchronisation: {name}")
        return fail

    for name in ("item", "tolist", "cpu", "numpy", "nonzero"):
        mp.setattr(torch.Tensor, name, forbidden(f"Tensor.{name}"))
    mp.setattr(torch, "nonzero", forbidden("torch.nonzero"))


#: transformers runs its "grouped_mm" experts on the CPU through a host-synchronising loop with torch <= 2.8, the
#: kernel from 2.9 on (`transformers.integrations.moe._can_use_grouped_mm`).
CPU_GROUPED_MM_KERNEL = is_torch_greater_or_equal("2.9", accept_dev=True)


@pytest.mark.parametrize("impl", [
    pytest.param("grouped_mm", marks=pytest.mark.skipif(not CPU_GROUPED_MM_KERNEL, reason="torch <= 2.8: transformers' "
                                                        "CPU fallback for grouped_mm reads the offsets on the host")),
    "batched_mm"])
def test_moe_forward_has_no_host_sync(model, impl):
    assert impl in ALL_EXPERTS_FUNCTIONS
    local = copy.deepcopy(model)
    local.set_experts_implementation(impl)
    assert local.config._experts_implementation == impl
    assert local.model.layers[1].mlp.experts.config._experts_implementation == impl
    ids = _ids(2, 12, 9)
    positions = torch.arange(12)[None].expand(2, 12)
    mask = block_causal_mask(positions, BLOCK)
    with torch.no_grad():
        want = model(ids, attention_mask=mask[:, None], position_ids=positions).logits
    with pytest.MonkeyPatch.context() as mp, torch.no_grad():
        _forbid_host_sync(mp)
        got_bool = local(ids, attention_mask=mask[:, None], position_ids=positions).logits
        got_add = local(ids, attention_mask=to_additive(mask, torch.float32), position_ids=positions).logits
    # the implementations compute the same thing (the fixture runs grouped_mm, the default)
    assert _max_diff(got_bool, want) <= 1e-5 and _max_diff(got_add, want) <= 1e-5


def test_host_sync_detector_trips_on_eager_experts(model):
    local = copy.deepcopy(model)
    local.set_experts_implementation("eager")
    assert local.config._experts_implementation == "eager"
    ids = _ids(1, 6, 10)
    mask = causal_mask(6)[None, None]
    with torch.no_grad():
        eager = local(ids, attention_mask=mask).logits
        want = model(ids, attention_mask=mask).logits
    assert _max_diff(eager, want) <= 1e-5
    with pytest.MonkeyPatch.context() as mp, torch.no_grad():
        _forbid_host_sync(mp)
        with pytest.raises(AssertionError, match="host synchronisation"):
            local(ids, attention_mask=mask)


def test_a_sliding_window_key_limits_nothing():
    """The Hub LLaDA2 config class carries `sliding_window` (4096) that neither modeling applies: no call is refused
    for it (a config.json with the key and without `use_sliding_window` would have been, beyond 4096 positions)."""
    from model_patches.llada2 import LLaDA2Patch

    model = LLaDA2MoeModelLM(LLaDA2MoeConfig(**TINY_LLADA2, sliding_window=16))
    assert model.config.sliding_window == 16 and LLaDA2Patch().attention_window(model) is None


def test_a_checkpoint_without_eos_keys_stops_at_the_hub_eos(llada2_model, tmp_path):
    """The Hub config.json has no `eos_token_id` (families.md §4.1): without a generation_config.json, the generation
    config transformers derived from that file had no stop id, and decoding never stopped at EOS. It now takes the
    Hub `generate`'s `eos_id` (the config's default, 156892); a checkpoint's own stop ids are kept."""
    from model_patches.llada2 import HUB_EOS_TOKEN_ID

    llada2_model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config.pop("eos_token_id", None)
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "generation_config.json").unlink()
    assert LLaDA2MoeModelLM.from_pretrained(tmp_path).generation_config.eos_token_id == HUB_EOS_TOKEN_ID
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 9]}))
    assert LLaDA2MoeModelLM.from_pretrained(tmp_path).generation_config.eos_token_id == [7, 9]
