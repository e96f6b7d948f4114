"""End-to-end checks on the bundled LLaDA2 MoE (`models/llada2-tiny`), real prompts, CPU fp32."""

from __future__ import annotations

import pytest
from safetensors import safe_open

from hf_dllm_spec.tools.jobs.evaluation import ROOT

MODEL_DIR = ROOT / "models" / "llada2-tiny"

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def bundled():
    from hf_dllm_spec.tools.jobs.evaluation import arithmetic_prompts, load

    tokenizer, model = load(MODEL_DIR)
    prompts = [tokenizer(p.text, return_tensors="pt").input_ids for p in arithmetic_prompts(MODEL_DIR, 4)]
    return tokenizer, model, prompts


def test_bundled_llada2_is_a_hub_layout_moe(bundled):
    from model_patches.llada2 import LLaDA2MoeModelLM

    tokenizer, model, _ = bundled
    assert type(model) is LLaDA2MoeModelLM and model.config.model_type == "llada2_moe"
    assert model.config.mask_token_id == tokenizer.mask_token_id
    with safe_open(str(MODEL_DIR / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert "model.layers.1.mlp.experts.0.gate_proj.weight" in keys and "model.layers.1.mlp.gate.expert_bias" in keys
    assert "model.layers.0.attention.query_key_value.weight" in keys and "model.word_embeddings.weight" in keys
    assert not any("gate_up_proj" in k or "e_score_correction_bias" in k for k in keys)


def test_bundled_llada2_editing_fires_and_threshold_decoding_saves_forwards(bundled):
    """On real prompts: LLaDA2.1 editing replaces committed tokens; threshold 0.9 needs <= 50% of AR's forwards."""
    _, model, prompts = bundled
    edited = committed = nfe = ar_nfe = 0
    for ids in prompts:
        ar = model.generate(ids, decoding_strategy="ar", max_new_tokens=48, return_dict_in_generate=True)
        dec = model.generate(ids, decoding_strategy="llada2", confidence_threshold=0.9, max_new_tokens=48,
                             return_dict_in_generate=True)
        quality = model.generate(ids, decoding_strategy="llada2", preset="llada2.1-quality", max_new_tokens=48,
                                 return_dict_in_generate=True)
        ar_nfe += ar.spec_stats.nfe
        nfe += dec.spec_stats.nfe
        edited += quality.spec_stats.num_edited_tokens
        committed += quality.spec_stats.num_committed_tokens
    assert nfe <= 0.5 * ar_nfe
    assert edited > 0 and committed > 0


def test_bundled_greedy_s2d2_always_verify_editing_off_equals_ar(bundled):
    _, model, prompts = bundled
    for ids in prompts[:2]:
        ar = model.generate(ids, decoding_strategy="ar", max_new_tokens=32)
        s2d2 = model.generate(ids, decoding_strategy="s2d2", block_size=32, max_new_tokens=32, min_ssd_span_length=1,
                              s2d2_acceptance="greedy_match", cache_ver=True, draft_ver=True)
        assert s2d2.tolist() == ar.tolist()


def test_bundled_hub_call_matches_the_library_call(bundled):
    tokenizer, model, prompts = bundled
    ids = prompts[0]
    hub = model.generate(ids, gen_length=48, block_length=32, threshold=0.7, editing_threshold=0.5, max_post_steps=16,
                         eos_early_stop=True, temperature=0.0)
    ours = model.generate(ids, decoding_strategy="llada2", max_new_tokens=48, confidence_threshold=0.7,
                          editing_threshold=0.5)[0, ids.shape[1]:]
    eos = tokenizer.eos_token_id
    cut = ours.tolist()[: ours.tolist().index(eos) + 1] if eos in ours.tolist() else ours.tolist()
    assert hub[0].tolist() == cut
