"""LLaDA2.x decoding: the family decoder (threshold + token editing) against a plain reference loop of the Hub
`generate` (no cache, whole window recomputed), the KV cache, batches, S2D2 with editing, and the Hub keywords.

Tiny random LLaDA2 MoE from config (conftest `llada2_model`, block size 4, mask 98), fp32, CPU, greedy.
"""

from __future__ import annotations

import pytest
import torch
from conftest import MASK_ID, gen, left_padded_batch

from hf_dllm_spec.strategies.block_diffusion import BlockDiffusionStrategy

B = 4
PROMPT = torch.tensor([5, 17, 42, 8, 23, 61, 4])          # one block prefilled, a tail of 3 in the first block
EDITING = dict(confidence_threshold=0.6, editing_threshold=0.1)   # low thresholds: edits fire on random weights


def reference_llada2(model, prompt: torch.Tensor, gen_length: int, *, threshold: float,
                     editing_threshold: float | None, max_post_steps: int, num_to_transfer: int | None,
                     steps: int = B, edits: list | None = None) -> list[int]:
    """The LLaDA2.x Hub loop (`strategies.md` §3), batch 1, greedy, no cache: every step recomputes the window
    `x[:(b+1)B]` under a hard block-causal mask. Editing off (`editing_threshold=None`) is LLaDA2.0: k from the
    steps schedule, the block ends when no mask is left. The mask token is suppressed, as in the library.
    `edits` (a list), when given, gets each step's count of edited tokens (T2T)."""
    P = len(prompt)
    num_blocks = -(-(P + gen_length) // B)
    x = torch.full((num_blocks * B,), MASK_ID)
    x[:P] = prompt
    for b in range(P // B, num_blocks):
        lo, hi = b * B, (b + 1) * B
        in_prompt = torch.arange(lo, hi) < P
        post, step = 0, 0
        while True:
            old = x[lo:hi].clone()
            active = old == MASK_ID
            if not active.any():
                if editing_threshold is None:
                    break
                post += 1
                if post > max_post_steps:
                    break
            blocks = torch.arange(hi) // B
            mask = torch.zeros(hi, hi).masked_fill(blocks[None, :] > blocks[:, None], torch.finfo(torch.float32).min)
            logits = model(x[:hi][None], attention_mask=mask[None, None]).logits[0, lo:hi]
            logits[:, MASK_ID] = float("-inf")
            conf, x0 = logits.softmax(-1).max(-1)
            if num_to_transfer is None:                       # LLaDA2.0: the schedule of a whole block
                n_steps = min(steps, B)
                k = B // n_steps + int(min(step, n_steps - 1) < B % n_steps)
            else:
                k = num_to_transfer
            k = min(k, int(active.sum()))
            m2t = active & (conf > threshold)
            if int(m2t.sum()) < k:
                m2t = torch.zeros_like(active)
                if k:
                    m2t[conf.masked_fill(~active, -1.0).topk(k).indices] = True
            t2t = torch.zeros_like(active)
            if editing_threshold is not None:
                t2t = ~active & ~in_prompt & (conf > editing_threshold) & (x0 != old)
            x[lo:hi] = torch.where(m2t | t2t, x0, old)
            if edits is not None:
                edits.append(int(t2t.sum()))
            step += 1
            if not active.any() and not t2t.any():
                break
    return x[P:P + gen_length].tolist()


def generated(out, prompt_length: int) -> list[int]:
    return out.sequences[0, prompt_length:].tolist()


@pytest.mark.parametrize("params", [
    dict(preset="llada2.0", confidence_threshold=0.6),
    dict(preset="llada2.0", confidence_threshold=0.95, steps_per_block=2),
    dict(EDITING, max_post_steps=0),
    dict(EDITING, max_post_steps=3),
    dict(confidence_threshold=0.95, editing_threshold=0.5, max_post_steps=16, num_to_transfer=2),
    dict(EDITING),
], ids=["2.0", "2.0-steps2", "2.1-post0", "2.1-post3", "2.1-k2", "2.1-default-post-steps"])
@pytest.mark.parametrize("use_cache", [True, False], ids=["cache", "no-cache"])
def test_decoder_equals_reference_hub_loop(llada2_model, params, use_cache):
    out = llada2_model.generate(PROMPT[None], decoding_strategy="llada2", block_size=B, max_new_tokens=16,
                                use_cache=use_cache, return_dict_in_generate=True, **params)
    preset_off = params.get("preset") == "llada2.0"
    edits = []
    expected = reference_llada2(
        llada2_model, PROMPT, 16, threshold=params["confidence_threshold"],
        editing_threshold=None if preset_off else params["editing_threshold"],
        max_post_steps=0 if preset_off else params.get("max_post_steps", 16),     # the Hub loop's default: 16
        num_to_transfer=None if preset_off else params.get("num_to_transfer", 1),
        steps=params.get("steps_per_block", B), edits=edits)
    assert generated(out, len(PROMPT)) == expected
    assert out.spec_stats.num_edited_tokens == sum(edits)      # tokens edited, not steps or rows that edit
    if not preset_off and params["editing_threshold"] < 0.3:
        assert out.spec_stats.num_edited_tokens > 0        # the case exercises editing


@pytest.mark.parametrize("length", [6, 9])
def test_llada20_schedule_is_the_whole_blocks_with_a_prompt_tail(llada2_model, length):
    """LLaDA2.0 sizes k by `block_length` / `steps` even where a prompt tail shares the block (2 masks, 2 steps:
    the Hub commits both at once, a schedule over the masks would take one per step)."""
    prompt = torch.arange(5, 5 + length)
    out = llada2_model.generate(prompt[None], decoding_strategy="llada2", preset="llada2.0", block_size=B,
                                max_new_tokens=10, steps_per_block=2, confidence_threshold=0.99)
    expected = reference_llada2(llada2_model, prompt, 10, threshold=0.99, editing_threshold=None, max_post_steps=0,
                                num_to_transfer=None, steps=2)
    assert out[0, length:].tolist() == expected


def test_s2d2_post_steps_never_verify_an_empty_span(llada2_model):
    out = llada2_model.generate(PROMPT[None], decoding_strategy="s2d2", block_size=B, max_new_tokens=16,
                                do_verify_policy="contextual_bandit_ucb", max_post_steps=3, return_dict_in_generate=True,
                                **EDITING)
    stats = out.spec_stats       # a verify forward over an empty span would count no draft
    assert stats.num_verify_forwards == stats.num_drafts > 0 and stats.num_edited_tokens > 0


def test_cached_decoder_equals_uncached_when_sampling(llada2_model):
    runs = [llada2_model.generate(PROMPT[None], decoding_strategy="llada2", block_size=B, max_new_tokens=16,
                                  do_sample=True, top_k=0, generator=gen(3), use_cache=c, **EDITING)
            for c in (True, False)]
    assert torch.equal(runs[0], runs[1])


def test_editing_off_is_block_diffusion(llada2_model):
    """LLaDA2.0 behaviour = block diffusion with the dynamic rule and the steps schedule."""
    a = llada2_model.generate(PROMPT[None], decoding_strategy="llada2", preset="llada2.0", block_size=B,
                              max_new_tokens=16, confidence_threshold=0.6)
    b = llada2_model.generate(PROMPT[None], decoding_strategy="block_diffusion", block_size=B, max_new_tokens=16,
                              confidence_threshold=0.6)
    assert torch.equal(a, b)


def test_prompt_tail_is_never_edited(llada2_model, monkeypatch):
    seen = []
    original = BlockDiffusionStrategy.apply_edits

    def spy(self, block, probs, tokens, confidence):
        before = block.tokens.clone()
        original(self, block, probs, tokens, confidence)
        seen.append((block.fixed.clone(), before != block.tokens, (tokens != before) & block.fixed))
    monkeypatch.setattr(BlockDiffusionStrategy, "apply_edits", spy)
    llada2_model.generate(PROMPT[None], decoding_strategy="llada2", block_size=B, max_new_tokens=16,
                          confidence_threshold=0.6, editing_threshold=1e-6)
    assert any(fixed.any() for fixed, _, _ in seen)                       # the tail shares the first block
    assert any(proposal_differs.any() for _, _, proposal_differs in seen)  # ... and the model proposes otherwise
    assert not any((changed & fixed).any() for fixed, changed, _ in seen)
    assert any(changed.any() for _, changed, _ in seen)                   # other positions were edited


def test_greedy_s2d2_always_verify_editing_off_equals_ar(llada2_model):
    for prompt in (PROMPT, PROMPT[:4], PROMPT[:2]):
        ar = llada2_model.generate(prompt[None], decoding_strategy="ar", max_new_tokens=12)
        s2d2 = llada2_model.generate(prompt[None], decoding_strategy="s2d2", block_size=B, max_new_tokens=12,
                                     min_ssd_span_length=1, s2d2_acceptance="greedy_match", cache_ver=True,
                                     draft_ver=True)
        assert s2d2.tolist() == ar.tolist()


def test_s2d2_never_verifying_is_the_family_decoder(llada2_model):
    """With routing that never verifies, S2D2 with editing commits and edits exactly as the LLaDA2.1 decoder."""
    common = dict(block_size=B, max_new_tokens=16, max_post_steps=2, num_to_transfer=1, **EDITING)
    s2d2 = llada2_model.generate(PROMPT[None], decoding_strategy="s2d2", do_verify_policy="score_threshold",
                                 do_verify_score_threshold=1e9, return_dict_in_generate=True, **common)
    family = llada2_model.generate(PROMPT[None], decoding_strategy="llada2", return_dict_in_generate=True, **common)
    assert torch.equal(s2d2.sequences, family.sequences)
    assert s2d2.spec_stats.num_verify_forwards == 0
    assert s2d2.spec_stats.num_edited_tokens == family.spec_stats.num_edited_tokens > 0


def test_s2d2_with_editing_verifies_and_cache_equals_no_cache(llada2_model):
    runs = [llada2_model.generate(PROMPT[None], decoding_strategy="s2d2", preset="llada2.1-mini-quality",
                                  block_size=B, max_new_tokens=16, use_cache=c, return_dict_in_generate=True,
                                  do_verify_policy="mask_span_length", editing_threshold=0.1)
            for c in (True, False)]
    assert torch.equal(runs[0].sequences, runs[1].sequences)
    assert runs[0].spec_stats.num_verify_forwards > 0 and runs[0].spec_stats.num_edited_tokens > 0


@pytest.mark.parametrize("strategy,params", [
    ("llada2", EDITING),
    ("llada2", {"preset": "llada2.0"}),
    ("s2d2", {"editing_threshold": 0.1, "confidence_threshold": 0.6}),
])
def test_batch_of_8_padded_equals_8_singles(llada2_model, strategy, params):
    ids, mask, prompts = left_padded_batch([1, 3, 4, 5, 7, 8, 11, 13])
    common = dict(decoding_strategy=strategy, block_size=B, max_new_tokens=14, eos_token_id=None, pad_token_id=0,
                  return_dict_in_generate=True, **params)
    out = llada2_model.generate(ids, attention_mask=mask, **common)
    width = ids.shape[1]
    for i, p in enumerate(prompts):
        single = llada2_model.generate(p[None], **common)
        new = single.sequences[0, len(p):].tolist()
        assert out.sequences[i, width:width + len(new)].tolist() == new, f"row {i}"
        assert out.spec_stats_per_row[i].num_edited_tokens == single.spec_stats.num_edited_tokens


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decoder_equals_the_reference_in_fp32_and_bf16(llada2_model, dtype):
    """The editing decoder in each dtype equals the Hub loop run on the same weights in that dtype."""
    model = llada2_model.to(dtype)
    try:
        out = model.generate(PROMPT[None], decoding_strategy="llada2", block_size=B, max_new_tokens=8,
                             use_cache=False, max_post_steps=2, **EDITING)
        expected = reference_llada2(model, PROMPT, 8, threshold=EDITING["confidence_threshold"],
                                    editing_threshold=EDITING["editing_threshold"], max_post_steps=2,
                                    num_to_transfer=1)
    finally:
        llada2_model.to(torch.float32)
    assert out[0, len(PROMPT):].tolist() == expected and MASK_ID not in expected


def test_plain_generate_runs_the_family_decoder(llada2_model):
    plain = llada2_model.generate(PROMPT[None], max_new_tokens=8)
    named = llada2_model.generate(PROMPT[None], decoding_strategy="llada2", max_new_tokens=8)
    assert torch.equal(plain, named)


def test_hub_generate_call_keeps_working(llada2_model):
    """The Hub signature: keywords mapped, only the generated tokens returned, cut after the first EOS."""
    kwargs = dict(gen_length=12, block_length=B, steps=B, threshold=0.6, editing_threshold=0.1, max_post_steps=2,
                  eos_early_stop=True, mask_id=MASK_ID, temperature=0.0, top_p=None, top_k=None)
    free = llada2_model.generate(PROMPT[None], eos_id=None, **{k: v for k, v in kwargs.items()})
    ours = llada2_model.generate(PROMPT[None], decoding_strategy="llada2", block_size=B, max_new_tokens=12,
                                 confidence_threshold=0.6, editing_threshold=0.1, max_post_steps=2, eos_token_id=None)
    assert free.tolist() == ours[:, len(PROMPT):].tolist()                 # generated part only
    eos = int(free[0, 5])
    cut = llada2_model.generate(PROMPT[None], eos_id=eos, **kwargs)
    first = free[0].tolist().index(eos)
    assert cut[0].tolist() == free[0, :first + 1].tolist()


def test_hub_call_with_return_dict_trims_the_sequences(llada2_model):
    out = llada2_model.generate(PROMPT[None], gen_length=8, block_length=B, steps=B, eos_id=None,
                                return_dict_in_generate=True)
    plain = llada2_model.generate(PROMPT[None], gen_length=8, block_length=B, steps=B, eos_id=None)
    assert torch.equal(out.sequences, plain) and out.spec_stats.nfe > 0


@pytest.mark.parametrize("kwargs,name", [
    ({"steps_per_block": 2}, "steps_per_block"),
    ({"editing_threshold": 1.5}, "editing_threshold"),
    ({"editing_threshold": 0.0}, "editing_threshold"),
    ({"max_post_steps": -1}, "max_post_steps"),
    ({"num_to_transfer": 0}, "num_to_transfer"),
    ({"minimal_topk": 2}, "minimal_topk"),
    ({"threshold": 0.9, "confidence_threshold": 0.9}, "threshold"),
])
def test_bad_editing_parameters_name_the_argument(llada2_model, kwargs, name):
    with pytest.raises(ValueError, match=name):
        llada2_model.generate(PROMPT[None], decoding_strategy="llada2", max_new_tokens=4, **kwargs)


def test_simsd_self_draft_on_llada2_is_the_targets_sequential_decoding(llada2_model):
    """SimSD runs on the family (position-aligned, paired or stacked layout); self-drafting with the exact preset
    accepts every draft and reproduces the target's sequential block diffusion."""
    out = llada2_model.generate(PROMPT[None], decoding_strategy="simsd", draft_model=llada2_model, block_size=B,
                                max_new_tokens=12, preset="simsd-exact", return_dict_in_generate=True)
    seq = llada2_model.generate(PROMPT[None], decoding_strategy="block_diffusion", block_size=B, max_new_tokens=12,
                                remasking_strategy="sequential")
    assert torch.equal(out.sequences, seq) and out.spec_stats.acceptance_rate == 1.0


def test_hub_steps_are_capped_at_gen_length():
    """The Hub LLaDA2.0 `generate` caps `steps` at `gen_length // minimal_topk` before scheduling a block (before:
    only the block size capped it, so a short `gen_length` committed one token per step, 2-4x the forwards)."""
    from model_patches.llada2 import map_hub_generate_kwargs

    mapped, hub_call = map_hub_generate_kwargs({"gen_length": 8, "block_length": 32, "steps": 32,
                                                "preset": "llada2.0"})
    assert hub_call and mapped["steps_per_block"] == 8 and mapped["max_new_tokens"] == 8
    assert map_hub_generate_kwargs({"gen_length": 64, "block_length": 32, "steps": 48,
                                    "preset": "llada2.0"})[0]["steps_per_block"] == 32
