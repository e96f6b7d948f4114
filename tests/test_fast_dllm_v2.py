"""Fast-dLLM v2 (`model_patches/fast_dllm_v2.py`): Hub layout, logits, the family decoder, S2D2, batches, keywords.

Tiny random checkpoints (fp32 unless a test says otherwise, CPU): Qwen2 modeling with q/k/v bias, right-shifted,
`bd_size` 8, mask token 98. The real Hub checkpoints are described in `/work/shared/reference/families.md` §3.
"""

from __future__ import annotations

import copy
import json
from dataclasses import fields

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, DynamicCache

from conftest import left_padded_batch
from hf_dllm_spec import SpecDecodingStats
from hf_dllm_spec.maths.masks import block_causal_mask, causal_mask, to_additive
from hf_dllm_spec.outputs import BatchStats
from hf_dllm_spec.runtime.runner import ModelRunner
from hf_dllm_spec.strategies.block_diffusion import BlockDiffusionStrategy
from hf_dllm_spec.strategies.fast_dllm_v2 import FastDLLMV2Config
from hf_dllm_spec.strategies.s2d2 import S2D2Strategy
from model_patches import get_patch
from model_patches.compat import cache_kwarg
from model_patches.fast_dllm_v2 import (
    MASK_TOKEN,
    Fast_dLLM_QwenConfig,
    Fast_dLLM_QwenForCausalLM,
    map_hub_generate_kwargs,
)
from model_patches.hub_generate import mask_token_from_files

MASK = 98
BD = 8
SIZES = dict(vocab_size=99, hidden_size=32, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2)
_TOKENS = [5, 17, 42, 8, 23, 61, 4, 9, 33, 7, 61, 12, 70, 2, 45, 88]
PROMPTS = {n: _TOKENS[:n] for n in (1, 3, 8, 11, 16)}
GREEDY = dict(eos_token_id=None, do_sample=False)


def _ids(n: int) -> torch.Tensor:
    return torch.tensor([PROMPTS[n]])


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model() -> Fast_dLLM_QwenForCausalLM:
    """Tiny random Fast-dLLM v2 model; large init so logits are peaked; a non-default RoPE theta (the Hub's)."""
    torch.manual_seed(0)
    config = Fast_dLLM_QwenConfig(initializer_range=0.2, bd_size=BD, mask_token_id=MASK, tie_word_embeddings=True,
                                  eos_token_id=None, rope_theta=1e6, attn_implementation="sdpa", **SIZES)
    return Fast_dLLM_QwenForCausalLM(config).eval()


@pytest.fixture(scope="module")
def bd16_model(model) -> Fast_dLLM_QwenForCausalLM:
    """The same weights declared with `bd_size` 16 (sub-blocks of 8 are then half a block)."""
    other = copy.deepcopy(model)
    other.config.bd_size = 16
    return other


# -- a pure-torch Qwen2 forward (the reference) -----------------------------------------------------------------
def _rope_theta(config) -> float:
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and params.get("rope_theta") is not None:
        return float(params["rope_theta"])
    return float(config.rope_theta)


def reference_forward(sd: dict[str, torch.Tensor], config, ids: torch.Tensor, positions: torch.Tensor,
                      allowed: torch.Tensor) -> torch.Tensor:
    """Qwen2 logits `(q, V)` of one sequence `ids (q,)` at `positions (q,)`; `allowed (q, q)` bool, True = attend."""
    sd = {k: v.float() for k, v in sd.items()}
    eps, heads, kv_heads = config.rms_norm_eps, config.num_attention_heads, config.num_key_value_heads
    hd = config.hidden_size // heads

    def rms(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w

    def rotate_half(x):
        return torch.cat([-x[..., hd // 2:], x[..., : hd // 2]], dim=-1)

    inv_freq = 1.0 / (_rope_theta(config) ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
    angles = positions.double()[:, None] * inv_freq[None]
    emb = torch.cat([angles, angles], dim=-1)
    cos, sin = emb.cos().float(), emb.sin().float()                       # (q, hd)
    q_len = ids.shape[0]
    h = sd["model.embed_tokens.weight"][ids]
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        x = rms(h, sd[p + "input_layernorm.weight"])
        q = x @ sd[p + "self_attn.q_proj.weight"].T + sd[p + "self_attn.q_proj.bias"]
        k = x @ sd[p + "self_attn.k_proj.weight"].T + sd[p + "self_attn.k_proj.bias"]
        v = x @ sd[p + "self_attn.v_proj.weight"].T + sd[p + "self_attn.v_proj.bias"]
        q = q.view(q_len, heads, hd).transpose(0, 1)                       # (H, q, hd)
        k = k.view(q_len, kv_heads, hd).transpose(0, 1)
        v = v.view(q_len, kv_heads, hd).transpose(0, 1)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        k = k.repeat_interleave(heads // kv_heads, dim=0)
        v = v.repeat_interleave(heads // kv_heads, dim=0)
        scores = (q @ k.transpose(-1, -2)) / hd ** 0.5
        scores = scores.masked_fill(~allowed[None], float("-inf"))
        attn = scores.softmax(-1) @ v                                      # (H, q, hd)
        h = h + attn.transpose(0, 1).reshape(q_len, heads * hd) @ sd[p + "self_attn.o_proj.weight"].T
        x = rms(h, sd[p + "post_attention_layernorm.weight"])
        gate = x @ sd[p + "mlp.gate_proj.weight"].T
        up = x @ sd[p + "mlp.up_proj.weight"].T
        h = h + (torch.nn.functional.silu(gate) * up) @ sd[p + "mlp.down_proj.weight"].T
    h = rms(h, sd["model.norm.weight"])
    head = sd.get("lm_head.weight", sd["model.embed_tokens.weight"])
    return h @ head.T


# -- 1. the Hub layout loads without remote code ----------------------------------------------------------------
def _qwen2_tensors(tied: bool, seed: int) -> dict[str, torch.Tensor]:
    """Random tensors under the exact Qwen2.5 / Fast-dLLM v2 Hub names, bfloat16 as on the Hub."""
    g = torch.Generator().manual_seed(seed)
    V, H, I, L = SIZES["vocab_size"], SIZES["hidden_size"], SIZES["intermediate_size"], SIZES["num_hidden_layers"]
    kv = SIZES["num_key_value_heads"] * (H // SIZES["num_attention_heads"])

    def rnd(*shape, scale=0.2):
        return (torch.randn(*shape, generator=g) * scale).to(torch.bfloat16)

    out = {"model.embed_tokens.weight": rnd(V, H), "model.norm.weight": (1 + rnd(H, scale=0.1).float()).bfloat16()}
    for i in range(L):
        p = f"model.layers.{i}."
        out |= {p + "self_attn.q_proj.weight": rnd(H, H), p + "self_attn.q_proj.bias": rnd(H),
                p + "self_attn.k_proj.weight": rnd(kv, H), p + "self_attn.k_proj.bias": rnd(kv),
                p + "self_attn.v_proj.weight": rnd(kv, H), p + "self_attn.v_proj.bias": rnd(kv),
                p + "self_attn.o_proj.weight": rnd(H, H),
                p + "mlp.gate_proj.weight": rnd(I, H), p + "mlp.up_proj.weight": rnd(I, H),
                p + "mlp.down_proj.weight": rnd(H, I),
                p + "input_layernorm.weight": (1 + rnd(H, scale=0.1).float()).bfloat16(),
                p + "post_attention_layernorm.weight": (1 + rnd(H, scale=0.1).float()).bfloat16()}
    if not tied:
        out["lm_head.weight"] = rnd(V, H)
    return out


HUB_EOS = [96, 95]            # the Hub's generation config: [151645 <|im_end|>, 151643 <|endoftext|>]


def _write_hub_checkpoint(directory, tied: bool, seed: int = 0) -> dict[str, torch.Tensor]:
    """A checkpoint directory exactly in the Hub layout: hand-written config.json, safetensors, tokenizer files."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    config = {
        "architectures": ["Fast_dLLM_QwenForCausalLM"],
        "auto_map": {"AutoConfig": "configuration.Fast_dLLM_QwenConfig",
                     "AutoModel": "modeling.Fast_dLLM_QwenModel",
                     "AutoModelForCausalLM": "modeling.Fast_dLLM_QwenForCausalLM"},
        "attention_dropout": 0.0, "bd_size": BD, "bos_token_id": 95, "conplemenrary_mask": True,
        "eos_token_id": 96, "hidden_act": "silu", "hidden_size": SIZES["hidden_size"], "initializer_range": 0.02,
        "intermediate_size": SIZES["intermediate_size"], "max_position_embeddings": 256, "max_window_layers": 2,
        "model_type": "Fast_dLLM_Qwen", "num_attention_heads": SIZES["num_attention_heads"],
        "num_hidden_layers": SIZES["num_hidden_layers"], "num_key_value_heads": SIZES["num_key_value_heads"],
        "pad_token_id": 96, "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000.0,
        "sliding_window": 4096, "tie_word_embeddings": tied, "torch_dtype": "bfloat16",
        "transformers_version": "4.53.1", "use_cache": True, "use_sliding_window": False,
        "vocab_size": SIZES["vocab_size"],
    }
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    (directory / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": 95, "eos_token_id": HUB_EOS, "pad_token_id": 95, "transformers_version": "4.53.1"}))
    tensors = _qwen2_tensors(tied, seed)
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(MASK)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok)
    tokenizer.add_special_tokens({"additional_special_tokens": [MASK_TOKEN]})
    tokenizer.save_pretrained(directory)
    assert tokenizer.convert_tokens_to_ids(MASK_TOKEN) == MASK
    return tensors


@pytest.mark.parametrize("tied", [False, True], ids=["7B-untied", "1.5B-tied"])
def test_hub_layout_loads_without_remote_code(tmp_path, tied):
    hub = tmp_path / "hub"
    hub.mkdir()
    written = _write_hub_checkpoint(hub, tied)
    model = AutoModelForCausalLM.from_pretrained(hub).eval()           # no trust_remote_code
    assert type(model) is Fast_dLLM_QwenForCausalLM
    assert model.config.model_type == "Fast_dLLM_Qwen" and model.config.bd_size == BD
    assert model.config.mask_token_id == MASK                          # from the tokenizer's |<MASK>| entry
    assert model.config.conplemenrary_mask is True
    assert _rope_theta(model.config) == 1e6
    # every tensor is what was written; the head is its own (7B) or the embedding (1.5B)
    loaded = model.state_dict()
    for name, tensor in written.items():
        assert torch.equal(loaded[name].to(tensor.dtype), tensor), name
    head, embed = model.get_output_embeddings().weight, model.get_input_embeddings().weight
    if tied:
        assert "lm_head.weight" not in written
        assert head.data_ptr() == embed.data_ptr()
        assert torch.equal(head.to(torch.bfloat16), written["model.embed_tokens.weight"])
    else:
        assert head.data_ptr() != embed.data_ptr()
        assert torch.equal(head.to(torch.bfloat16), written["lm_head.weight"])
        assert not torch.equal(written["lm_head.weight"], written["model.embed_tokens.weight"])
    # the family adapter: stop ids from the generation config, right shift, trained block size = bd_size
    patch = get_patch(model)
    assert patch.stop_token_ids(model, model.generation_config) == HUB_EOS
    assert patch.alignment_of(model) == "right_shift"
    assert patch.trained_block_size(model) == BD
    assert patch.mask_token_id(model) == MASK
    # the loaded model computes the Qwen2 function of the written tensors (fp32 load of the bf16 weights)
    fp32 = AutoModelForCausalLM.from_pretrained(hub, dtype=torch.float32).eval()
    ids = torch.tensor([5, 17, 42, 8, 23, 61, 4, 9, 33, 7])
    with torch.no_grad():
        ours = fp32(input_ids=ids[None]).logits[0]
    ref = reference_forward(written, fp32.config, ids, torch.arange(10), causal_mask(10))
    assert (ours - ref).abs().max() <= 1e-4
    # plain generate decodes with the family loop, the tokenizer's mask token and the generation config's stop ids
    prompt = [5, 17, 42, 8, 23]
    new = fp32.generate(torch.tensor([prompt]), max_new_tokens=12)[0, len(prompt):].tolist()
    expected = reference_hub_generate(fp32, prompt, 12, BD, 8, 0.9)
    stops = [i for i, t in enumerate(expected) if t in HUB_EOS]
    assert new == (expected[: stops[0] + 1] if stops else expected)
    fp32.generation_config.eos_token_id = [expected[4], HUB_EOS[1]]     # a stop id the decoder does emit
    new = fp32.generate(torch.tensor([prompt]), max_new_tokens=12)[0, len(prompt):].tolist()
    assert new == expected[: expected.index(expected[4]) + 1]
    # save -> reload keeps the Hub spelling of the training flag and the resolved mask token
    out = tmp_path / "saved"
    model.save_pretrained(out)
    saved = json.loads((out / "config.json").read_text())
    assert saved["conplemenrary_mask"] is True and "complementary_mask" not in saved
    assert saved["model_type"] == "Fast_dLLM_Qwen" and saved["bd_size"] == BD and saved["mask_token_id"] == MASK
    # the Hub's remote-code modules are not saved, so the saved config must not point at them
    assert not any("modeling.Fast_dLLM" in ref or "configuration.Fast_dLLM" in ref
                   for ref in (saved.get("auto_map") or {}).values())
    again = AutoModelForCausalLM.from_pretrained(out).eval()
    # the Hub auto_map's AutoModel resolves too: the decoder stack without the head, same hidden states
    from transformers import AutoModel

    base = AutoModel.from_pretrained(hub, dtype=torch.float32).eval()
    assert type(base).__name__ == "Fast_dLLM_QwenModel"
    ids = torch.tensor([[3, 9, 4, 27]])
    torch.testing.assert_close(base(ids).last_hidden_state, fp32.model(ids).last_hidden_state, rtol=0, atol=1e-5)
    assert type(again) is Fast_dLLM_QwenForCausalLM
    assert again.config.conplemenrary_mask is True and again.config.mask_token_id == MASK
    assert get_patch(again).stop_token_ids(again, again.generation_config) == HUB_EOS
    for name, tensor in written.items():
        assert torch.equal(again.state_dict()[name].to(tensor.dtype), tensor), name


@pytest.mark.parametrize("source", ["tokenizer.json", "added_tokens.json", "tokenizer_config.json", None])
def test_mask_token_from_each_tokenizer_file(tmp_path, source):
    """`|<MASK>|` is found in whichever tokenizer file names it (the Hub repos carry all three)."""
    entry = {"id": 77, "content": MASK_TOKEN, "special": True}
    files = {"tokenizer.json": {"added_tokens": [{"id": 3, "content": "<|im_end|>"}, entry]},
             "added_tokens.json": {"<|im_end|>": 3, MASK_TOKEN: 77},
             "tokenizer_config.json": {"added_tokens_decoder": {"3": {"content": "<|im_end|>"},
                                                                "77": {"content": MASK_TOKEN}}}}
    if source is not None:
        (tmp_path / source).write_text(json.dumps(files[source]))
    else:           # files without the token
        (tmp_path / "tokenizer.json").write_text(json.dumps({"added_tokens": [{"id": 3, "content": "<|im_end|>"}]}))
    assert mask_token_from_files(tmp_path, MASK_TOKEN) == (77 if source is not None else None)


# -- 2. logits equal the reference forward, with and without a cache ----------------------------------------------
SEQ = torch.tensor([5, 17, 42, 8, 23, 61, 4, 9, 33, 7, 61, MASK, MASK])


@pytest.mark.parametrize("pattern", ["block_causal_4", "causal"])
def test_logits_equal_reference_forward(model, pattern):
    q = SEQ.shape[0]
    positions = torch.arange(q)
    allowed = block_causal_mask(positions, 4) if pattern == "block_causal_4" else causal_mask(q)
    ref = reference_forward(model.state_dict(), model.config, SEQ, positions, allowed)
    with torch.no_grad():
        out = model(input_ids=SEQ[None], position_ids=positions[None],
                    attention_mask=to_additive(allowed[None], torch.float32)).logits[0]
    assert (out - ref).abs().max() <= 1e-4
    # the mask matters (the comparison can fail): a full mask gives other logits
    other = reference_forward(model.state_dict(), model.config, SEQ, positions, torch.ones(q, q, dtype=torch.bool))
    assert (other - ref).abs().max() > 1e-2


@pytest.mark.parametrize("pattern", ["block_causal_4", "causal"])
def test_cached_logits_equal_reference_forward(model, pattern):
    """A stored prefix then a read-only forward give the logits of one forward over the whole sequence."""
    q, prefix = SEQ.shape[0], 8
    positions = torch.arange(q)
    allowed = block_causal_mask(positions, 4) if pattern == "block_causal_4" else causal_mask(q)
    ref = reference_forward(model.state_dict(), model.config, SEQ, positions, allowed)
    # raw transformers: DynamicCache, two forwards with 4D additive masks
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        first = model(input_ids=SEQ[None, :prefix], position_ids=positions[None, :prefix],
                      attention_mask=to_additive(allowed[None, :prefix, :prefix], torch.float32),
                      **cache_kwarg(cache), use_cache=True).logits[0]
        second = model(input_ids=SEQ[None, prefix:], position_ids=positions[None, prefix:],
                       attention_mask=to_additive(allowed[None, prefix:, :], torch.float32),
                       **cache_kwarg(cache), use_cache=True).logits[0]
    assert (first - ref[:prefix]).abs().max() <= 1e-4
    assert (second - ref[prefix:]).abs().max() <= 1e-4
    # the library's runner: store the prefix, read the rest; right-shift aligned (entry i predicts query token i)
    for use_cache in (True, False):
        runner = ModelRunner(model, get_patch(model), BatchStats(1), batch_size=1, use_cache=use_cache)
        assert runner.alignment == "right_shift"
        stored = runner.forward(SEQ[None, :prefix], positions[None, :prefix], allowed[:prefix, :prefix],
                                kind="prefill", store_len=prefix)
        read = runner.forward(SEQ[None, prefix:], positions[None, prefix:], allowed[prefix:, prefix:],
                              kind="draft")
        assert runner.stored_len == prefix
        # stored[i] (i >= 1) is the prediction of token i: raw row i - 1
        assert (stored[0, 1:] - ref[: prefix - 1]).abs().max() <= 1e-4
        # the first read-only token takes the carry: the last stored token's logits
        assert (read[0, 0] - ref[prefix - 1]).abs().max() <= 1e-4
        assert (read[0, 1:] - ref[prefix:-1]).abs().max() <= 1e-4
        # the shift is real: unshifted rows differ
        assert (read[0, 1:] - ref[prefix + 1:]).abs().max() > 1e-2


# -- 3. the family decoder is static block diffusion with separate writes; Hub keywords -----------------------------
@pytest.mark.parametrize("length", [8, 11, 3])
def test_family_decoder_equals_static_block_diffusion(model, length):
    ids = _ids(length)
    ours = model.generate(ids, decoding_strategy="fast_dllm_v2", sub_block_size=8, confidence_threshold=1.0,
                          block_size=8, max_new_tokens=16, **GREEDY)
    static = model.generate(ids, decoding_strategy="block_diffusion", remasking_strategy="low_confidence_static",
                            fuse_cache_write=False, block_size=8, max_new_tokens=16, **GREEDY)
    assert ours.shape == (1, length + 16)
    assert ours.tolist() == static.tolist()
    assert torch.equal(ours[:, :length], ids)
    # the Hub keywords give the same call
    hub = model.generate(ids, max_new_tokens=16, threshold=1.0, small_block_size=8, block_size=8, mask_id=MASK,
                         temperature=0, eos_token_id=None)
    assert hub.tolist() == ours.tolist()
    # plain generate runs the family decoder with its defaults: block size from bd_size, sub-blocks of 8, tau 0.9
    plain = model.generate(ids, max_new_tokens=16, eos_token_id=None)
    default = model.generate(ids, decoding_strategy="fast_dllm_v2", max_new_tokens=16, eos_token_id=None)
    explicit = model.generate(ids, decoding_strategy="block_diffusion", block_size=BD, sub_block_size=8,
                              confidence_threshold=0.9, fuse_cache_write=False, max_new_tokens=16, eos_token_id=None)
    assert plain.tolist() == default.tolist() == explicit.tolist()


def test_defaults_follow_the_checkpoint(model, bd16_model):
    """Without arguments: blocks of `bd_size`, sub-blocks of 8, tau 0.9, separate writes (checked where they matter:
    with bd_size 16 the sub-blocks are not the whole block)."""
    cfg = FastDLLMV2Config()
    assert (cfg.block_size, cfg.sub_block_size, cfg.confidence_threshold, cfg.fuse_cache_write) == (None, 8, 0.9,
                                                                                                     False)
    differs_from_whole_blocks = differs_from_bd8 = 0
    for length in (3, 11):
        ids = _ids(length)
        plain = bd16_model.generate(ids, max_new_tokens=16, eos_token_id=None)
        explicit = bd16_model.generate(ids, decoding_strategy="block_diffusion", block_size=16, sub_block_size=8,
                                       confidence_threshold=0.9, fuse_cache_write=False, max_new_tokens=16,
                                       eos_token_id=None)
        assert plain.tolist() == explicit.tolist()
        whole = bd16_model.generate(ids, max_new_tokens=16, eos_token_id=None, sub_block_size=16)
        differs_from_whole_blocks += plain.tolist() != whole.tolist()
        differs_from_bd8 += plain.tolist() != model.generate(ids, max_new_tokens=16, eos_token_id=None).tolist()
    assert differs_from_whole_blocks and differs_from_bd8


def reference_hub_generate(model, prompt: list[int], max_new_tokens: int, block_size: int, sub_block_size: int,
                           threshold: float) -> list[int]:
    """The Hub's greedy sub-block loop (strategies.md §4), recomputed from scratch at every step (no cache).

    Every forward covers the whole sequence under the block-causal eval mask (block-causal keys and values are
    exactly what the Hub's block cache stores). Right shift: position i is predicted by the logits at i - 1. A
    block's first position, when it is not prompt, is the argmax at the position before it (the Hub's "append the
    argmax of the last logit", prompts of exactly one block included). MASK is suppressed (the library's
    documented deviation; the Hub's argmax could pick it).
    """
    B, SB = block_size, sub_block_size

    def logits_of(seq):
        ids = torch.tensor(seq)
        allowed = block_causal_mask(torch.arange(len(seq)), B)
        with torch.no_grad():
            out = model(input_ids=ids[None], position_ids=torch.arange(len(seq))[None],
                        attention_mask=to_additive(allowed[None], torch.float32)).logits[0].float()
        out[:, MASK] = float("-inf")
        return out

    seq, end = list(prompt), len(prompt) + max_new_tokens
    while len(seq) < end:
        start = len(seq) // B * B
        if len(seq) % B == 0:
            seq.append(int(logits_of(seq)[-1].argmax()))
        x = seq + [MASK] * (start + B - len(seq))
        while MASK in x[start:]:
            first = x.index(MASK, start)
            lo = start + (first - start) // SB * SB
            logits = logits_of(x)
            shifted = torch.cat([logits[:1], logits[:-1]])                  # the Hub's right shift: i - 1 -> i
            probs = shifted[lo: lo + SB].softmax(-1)
            conf, tok = probs.max(-1)
            masked = torch.tensor([t == MASK for t in x[lo: lo + SB]])
            conf = conf.masked_fill(~masked, -1.0)
            commit = masked & (conf > threshold)
            commit[int(conf.argmax())] = True
            for j in commit.nonzero().flatten().tolist():
                x[lo + j] = int(tok[j])
        seq = x
    return seq[len(prompt): end]


@pytest.mark.parametrize("block_size,sub_block_size,threshold", [(8, 8, 1.0), (8, 4, 0.1), (8, 2, 0.08),
                                                                 (16, 8, 0.1)])
@pytest.mark.parametrize("length", [1, 3, 8, 11, 16])
def test_family_decoder_equals_hub_loop(model, bd16_model, length, block_size, sub_block_size, threshold):
    m = model if block_size == BD else bd16_model
    ids = _ids(length)
    ours = m.generate(ids, max_new_tokens=14, threshold=threshold, small_block_size=sub_block_size,
                      eos_token_id=None, return_dict_in_generate=True)
    ref = reference_hub_generate(m, PROMPTS[length], 14, block_size, sub_block_size, threshold)
    assert ours.sequences[0, length:].tolist() == ref
    if threshold < 0.5:        # the threshold really commits several tokens in some steps
        assert ours.spec_stats.num_denoising_steps < ours.spec_stats.num_committed_tokens - 1


def test_one_block_prompt_is_prefilled(model):
    """A prompt of exactly one block is stored (the Hub's `P > B` skips it) and the new block starts after it."""
    out = model.generate(_ids(8), decoding_strategy="fast_dllm_v2", max_new_tokens=8, return_dict_in_generate=True,
                         confidence_threshold=1.0, **GREEDY)
    stats = out.spec_stats
    assert stats.num_prefill_forwards == 1
    # first token from the prefill's last logit (carry), 7 more one per denoising step, then the block's write
    assert stats.num_draft_forwards == 7 and stats.num_cache_write_forwards == 1
    with torch.no_grad():
        last = model(input_ids=_ids(8), attention_mask=to_additive(block_causal_mask(torch.arange(8), BD)[None],
                                                                     torch.float32)).logits[0, -1]
    assert int(out.sequences[0, 8]) == int(last.argmax())


def test_hub_mask_id_and_stop_token(model, monkeypatch):
    ids = _ids(3)
    ref = model.generate(ids, max_new_tokens=16, threshold=1.0, eos_token_id=None)
    monkeypatch.setattr(model.config, "mask_token_id", None)
    with pytest.raises(ValueError, match="mask_token_id"):
        model.generate(ids, max_new_tokens=16, threshold=1.0, eos_token_id=None)
    assert model.generate(ids, max_new_tokens=16, threshold=1.0, mask_id=MASK, eos_token_id=None).tolist() == \
        ref.tolist()
    monkeypatch.undo()
    new = ref[0, 3:].tolist()
    stop = new[5]
    cut = new.index(stop)
    stopped = model.generate(ids, max_new_tokens=16, threshold=1.0, stop_token=stop)
    assert stopped[0, 3:].tolist() == new[: cut + 1]
    assert stopped.tolist() == model.generate(ids, max_new_tokens=16, threshold=1.0, eos_token_id=stop).tolist()


# -- 4. greedy S2D2 with always-on verification and AR caching is AR -------------------------------------------------
@pytest.mark.parametrize("fuse", [True, False], ids=["fused", "separate-writes"])
@pytest.mark.parametrize("sub_block_size", [8, 4, 2])
def test_s2d2_always_verify_equals_ar(model, sub_block_size, fuse):
    for length in (3, 11):
        ids = _ids(length)
        ar = model.generate(ids, decoding_strategy="ar", max_new_tokens=16, **GREEDY)
        s2d2 = model.generate(ids, decoding_strategy="s2d2", block_size=8, sub_block_size=sub_block_size,
                              min_ssd_span_length=1, cache_ver=True, fuse_cache_write=fuse, max_new_tokens=16,
                              return_dict_in_generate=True, **GREEDY)
        assert s2d2.sequences.tolist() == ar.tolist(), f"prompt of {length}"
        assert s2d2.spec_stats.num_verify_forwards > 0
        # the verified span C_t ends with its sub-block: never more drafts per cycle than a sub-block holds
        longest_span = len(s2d2.spec_stats.num_drafts_reaching_pos)
        assert longest_span <= sub_block_size
        if sub_block_size < BD:
            assert longest_span == sub_block_size


# -- 5. sub-blocks are decoded strictly left to right -----------------------------------------------------------------
def _record_steps(monkeypatch) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Patch both `denoise_step`s to record, per step, the undecided block positions before and after it."""
    log: list[tuple[torch.Tensor, torch.Tensor]] = []

    def recording(original):
        def denoise_step(self, block, logits):
            before = block.undecided.clone()
            original(self, block, logits)
            log.append((before, block.undecided.clone()))
        return denoise_step

    for cls in (BlockDiffusionStrategy, S2D2Strategy):
        monkeypatch.setattr(cls, "denoise_step", recording(cls.__dict__["denoise_step"]))
    return log


def _out_of_order_steps(log, sub: int) -> int:
    """Steps that committed a position of a later sub-block while an earlier one still had a mask."""
    bad = 0
    for before, after in log:
        committed = before & ~after
        for row in range(before.shape[0]):
            masked = before[row].nonzero().flatten()
            if masked.numel() == 0:
                continue
            current = int(masked[0]) // sub
            positions = committed[row].nonzero().flatten()
            bad += int(bool((positions // sub > current).any()))
    return bad


@pytest.mark.parametrize("strategy,extra", [("fast_dllm_v2", {}), ("s2d2", {"min_ssd_span_length": 3})])
def test_sub_blocks_decode_left_to_right(model, monkeypatch, strategy, extra):
    ids = torch.tensor([[5, 17, 42], [9, 3, 77]])
    kwargs = dict(max_new_tokens=21, block_size=8, confidence_threshold=0.1, attention_mask=torch.ones_like(ids),
                  pad_token_id=0, return_dict_in_generate=True, decoding_strategy=strategy, **extra, **GREEDY)
    log = _record_steps(monkeypatch)
    out = model.generate(ids, sub_block_size=4, **kwargs)
    assert max(r.num_denoising_steps for r in out.spec_stats_per_row) <= len(log)      # one entry per batched step
    assert len(log) > 4
    assert max(int((b & ~a).sum(dim=1).max()) for b, a in log) > 1    # several commits in one step happen
    assert _out_of_order_steps(log, 4) == 0
    # every step commits inside the current sub-block only, and at least one token per row with masks
    for before, after in log:
        committed = before & ~after
        for row in range(before.shape[0]):
            masked = before[row].nonzero().flatten()
            if masked.numel():
                lo = int(masked[0]) // 4 * 4
                assert committed[row, :lo].sum() == 0 and committed[row, lo + 4:].sum() == 0
                assert committed[row].sum() >= 1
    if strategy == "s2d2":      # both routes ran
        assert 0 < out.spec_stats.num_verify_forwards < out.spec_stats.num_denoising_steps
    # control: without sub-blocks the same call commits across the sub-block boundary (the check can fail)
    log.clear()
    model.generate(ids, sub_block_size=8, **kwargs)
    assert _out_of_order_steps(log, 4) > 0


# -- 6. batches equal singles ---------------------------------------------------------------------------------------
LENGTHS = [1, 3, 4, 5, 7, 8, 11, 13]
BATCH_COMMON = dict(eos_token_id=None, pad_token_id=0, max_new_tokens=14, return_dict_in_generate=True)
TIMES_AND_CALLS = {"wall_time_s", "prefill_time_s", "forward_time_s", "num_forward_calls"}


def _counters(stats: SpecDecodingStats) -> dict:
    return {f.name: getattr(stats, f.name) for f in fields(stats) if f.name not in TIMES_AND_CALLS}


@pytest.mark.parametrize("strategy,extra", [
    ("fast_dllm_v2", {}),
    ("s2d2", {}),
    ("s2d2", {"min_ssd_span_length": 3, "fuse_cache_write": False}),
    # fused writes on a right-shifted model: a row that stores padding reads its block's first logit from the carry
    ("block_diffusion", {"confidence_threshold": 0.1}),
    ("s2d2", {"min_ssd_span_length": 3, "confidence_threshold": 0.1}),
], ids=["fast_dllm_v2", "s2d2", "s2d2-routed-separate", "block_diffusion-fused", "s2d2-routed-fused"])
def test_batch_equals_singles(model, strategy, extra):
    ids, mask, prompts = left_padded_batch(LENGTHS)
    kwargs = dict(BATCH_COMMON, decoding_strategy=strategy, sub_block_size=4, block_size=8, **extra)
    out = model.generate(ids, attention_mask=mask, **kwargs)
    summed = SpecDecodingStats()
    rows = []
    for i, p in enumerate(prompts):
        single = model.generate(p[None], **kwargs)
        new = single.sequences[0, len(p):].tolist()
        assert len(new) == 14
        rows.append(new)
        assert out.sequences[i, ids.shape[1]:].tolist() == new, f"row {i} (prompt of {len(p)} tokens)"
        assert _counters(out.spec_stats_per_row[i]) == _counters(single.spec_stats), f"row {i} statistics"
        summed.merge(single.spec_stats)
    assert _counters(out.spec_stats) == _counters(summed)
    assert out.spec_stats.num_forward_calls < summed.num_forward_calls
    assert len({tuple(r) for r in rows}) > 1                          # rows are not all the same
    if strategy == "s2d2":
        assert out.spec_stats.num_verify_forwards > 0


# -- 7. Hub keyword mapping ---------------------------------------------------------------------------------------
def test_use_block_cache_is_refused(model):
    with pytest.raises(NotImplementedError, match="use_block_cache"):
        map_hub_generate_kwargs({"use_block_cache": True})
    with pytest.raises(NotImplementedError, match="use_block_cache"):
        model.generate(_ids(3), max_new_tokens=8, use_block_cache=True)
    assert map_hub_generate_kwargs({"use_block_cache": False}) == {}
    ids = _ids(3)
    assert model.generate(ids, max_new_tokens=8, use_block_cache=False, eos_token_id=None).tolist() == \
        model.generate(ids, max_new_tokens=8, eos_token_id=None).tolist()


def test_hub_keyword_mapping():
    assert map_hub_generate_kwargs({"temperature": 0.7, "top_p": 0.9}) == {"temperature": 0.7, "top_p": 0.9,
                                                                         "do_sample": True}
    assert map_hub_generate_kwargs({"temperature": 0, "top_p": 0.95}) == {"do_sample": False}
    assert map_hub_generate_kwargs({"threshold": 0.9, "small_block_size": 8, "block_size": 32, "mask_id": 7,
                                    "stop_token": 3}) == {"confidence_threshold": 0.9, "sub_block_size": 8,
                                                          "block_size": 32, "mask_token_id": 7, "eos_token_id": 3}
    # this library's own names pass through; an explicit do_sample wins over the temperature rule
    assert map_hub_generate_kwargs({"sub_block_size": 4, "temperature": 0.5, "do_sample": False}) == \
        {"sub_block_size": 4, "temperature": 0.5, "do_sample": False}
    with pytest.raises(ValueError, match="temperature"):
        map_hub_generate_kwargs({"temperature": -1.0})
    # sampling through the Hub keywords keeps the Hub's default nucleus
    assert map_hub_generate_kwargs({"temperature": 0.7}) == {"temperature": 0.7, "do_sample": True, "top_p": 0.95}
    # a Hub keyword and the name it maps to: refused, never one silently winning
    with pytest.raises(ValueError, match="`threshold`.*`confidence_threshold`"):
        map_hub_generate_kwargs({"threshold": 0.5, "confidence_threshold": 0.7})


def test_hub_sampling_is_reproducible(model):
    ids = _ids(3)
    kwargs = dict(max_new_tokens=16, temperature=0.7, top_p=0.9, eos_token_id=None)
    runs = [model.generate(ids, generator=torch.Generator().manual_seed(s), **kwargs) for s in (0, 0, 1, 2)]
    assert runs[0].tolist() == runs[1].tolist()
    assert not (runs[0].tolist() == runs[2].tolist() == runs[3].tolist())
    # top_p reaches the sampler: a tiny nucleus keeps one token, and every seed gives the same tokens
    narrow = [model.generate(ids, generator=torch.Generator().manual_seed(s), **{**kwargs, "top_p": 1e-6})
              for s in (0, 1, 2)]
    assert narrow[0].tolist() == narrow[1].tolist() == narrow[2].tolist()


class _ForwardCounter:
    def __init__(self, model):
        self.calls = 0
        self.handle = model.register_forward_pre_hook(self)

    def __call__(self, module, args):
        self.calls += 1


@pytest.mark.parametrize("kwargs", [{"sub_block_size": 3, "block_size": 8}, {"small_block_size": 3, "block_size": 8},
                                    {"sub_block_size": 3}, {"sub_block_size": 16, "block_size": 8}],
                         ids=["ours", "hub", "bd_size", "larger"])
def test_sub_block_size_must_divide_block_size(model, kwargs):
    counter = _ForwardCounter(model)
    try:
        with pytest.raises(ValueError, match="sub_block_size"):
            model.generate(_ids(11), max_new_tokens=8, **GREEDY, **kwargs)
    finally:
        counter.handle.remove()
    assert counter.calls == 0


# -- 8. forward accounting ------------------------------------------------------------------------------------------
def _greedy_ar(model, ids: torch.Tensor, n: int) -> list[int]:
    """Plain greedy AR with full causal recomputation (no cache, no library)."""
    seq = ids[0].tolist()
    with torch.no_grad():
        for _ in range(n):
            seq.append(int(model(input_ids=torch.tensor([seq])).logits[0, -1].argmax()))
    return seq


@pytest.mark.parametrize("length", [1, 8, 11])
def test_ar_costs_one_forward_per_token(model, length):
    ids = torch.tensor([[5, 17, 42, 8, 23, 61, 4, 9, 33, 7, 61][:length]])
    n = 12
    separate = model.generate(ids, decoding_strategy="ar", fuse_cache_write=False, max_new_tokens=n,
                              return_dict_in_generate=True, **GREEDY)
    fused = model.generate(ids, decoding_strategy="ar", max_new_tokens=n, return_dict_in_generate=True, **GREEDY)
    assert separate.sequences.tolist() == fused.sequences.tolist() == [_greedy_ar(model, ids, n)]
    s, f = separate.spec_stats, fused.spec_stats
    assert s.num_prefill_forwards == f.num_prefill_forwards == 1
    assert s.nfe == f.nfe == 1 + n
    assert s.num_cache_write_forwards == n and s.num_draft_forwards == 0      # each token from the carry
    assert f.num_cache_write_forwards == 0 and f.num_draft_forwards == n
    assert s.num_generated_tokens == f.num_generated_tokens == n
    assert s.num_committed_tokens == s.num_fallback_tokens == n     # the carry's commits are counted (were not)
    assert separate.spec_stats_per_row[0].nfe == 1 + n and s.num_forward_calls == 1 + n
