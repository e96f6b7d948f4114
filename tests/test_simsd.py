"""SimSD (Cui et al.): a small dLLM drafts, a large dLLM of the same family verifies every draft in one forward.

Tiny random SDAR models built from config. The mask trick is compared with separate plain forwards of the
target over the block state before each reveal step: exact for the paired layout (Eq. 1) on a one-layer target
and for the stacked layout at any depth. Self-drafting accepts everything and reproduces the target's own block
diffusion; a left-to-right drafter reproduces the target's sequential block diffusion for any drafter;
rejection sampling follows the target (chi-square with a negative control); batches equal singles; the cache
equals the no-cache path and holds only full committed blocks.
"""

from __future__ import annotations

import pytest
import torch
from conftest import MASK_ID, TINY, left_padded_batch
from scipy.stats import chisquare

from hf_dllm_spec.maths import verification
from hf_dllm_spec.maths.masks import block_causal_mask, temporal_verify_mask, to_additive
from hf_dllm_spec.maths.sampling import Sampler
from hf_dllm_spec.strategies.simsd import SimSDConfig, SimSDStrategy, gate_stop_tokens, verification_order
from hf_dllm_spec.maths.verification import greedy_match
from model_patches.sdar import SDARConfig, SDARForCausalLM

B = 4
PROMPT = torch.tensor([[5, 17, 42, 8, 23, 61, 4]])      # 7 tokens: a 3-token prompt tail in the first block


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _sdar(seed: int, layers: int = 2, **overrides) -> SDARForCausalLM:
    torch.manual_seed(seed)
    config = {**TINY, "num_hidden_layers": layers, **overrides}
    return SDARForCausalLM(SDARConfig(block_size=B, mask_token_id=MASK_ID, **config)).eval()


@pytest.fixture(scope="module")
def target():
    return _sdar(0)


@pytest.fixture(scope="module")
def target_1l():
    return _sdar(3, layers=1)


@pytest.fixture(scope="module")
def drafter():
    return _sdar(7)


def _simsd(target, drafter, ids, **kwargs):
    kwargs.setdefault("max_new_tokens", 24)
    kwargs.setdefault("eos_token_id", None)
    return target.generate(ids, decoding_strategy="simsd", draft_model=drafter, **kwargs)


def _block_diffusion(model, ids, **kwargs):
    kwargs.setdefault("max_new_tokens", 24)
    kwargs.setdefault("eos_token_id", None)
    return model.generate(ids, decoding_strategy="block_diffusion", steps_per_block=B, **kwargs)


# -- Eq. 1 --------------------------------------------------------------------------------------------------------
def test_temporal_mask_follows_the_four_rules_of_eq1():
    steps = torch.tensor([[0, 2, 1, 3], [0, 0, 1, 1]])           # row 1: leftover of 2, two drafts revealed together
    mask = temporal_verify_mask(steps)
    for n in range(2):
        tau = steps[n].tolist()
        for i in range(2 * B):
            for j in range(2 * B):
                ti, tj = tau[i % B], tau[j % B]
                data_i, data_j = i < B, j < B
                if data_i and data_j:
                    expected = tj <= ti
                elif data_i:
                    expected = ti > 0 and tj > ti
                elif data_j:
                    expected = ti > 0 and tj < ti
                else:
                    expected = (ti > 0 and tj > 0 and tj >= ti) or i == j
                assert bool(mask[n, i, j]) == expected, (n, i, j)


def test_verification_order_position_and_temporal():
    drafted = torch.tensor([[False, True, True, True]])
    steps = torch.tensor([[0, 3, 1, 2]])
    assert verification_order(drafted, steps, "position").tolist() == [[1, 2, 3, 0]]
    assert verification_order(drafted, steps, "temporal").tolist() == [[2, 3, 1, 0]]


# -- the mask trick == separate target forwards over the block state before each reveal step ------------------------
def _plain_block_logits(model, context: torch.Tensor, block: torch.Tensor) -> torch.Tensor:
    """Straightforward forward of `[context | block]` with the block-diffusion mask (no cache); `(B, V)`."""
    ids = torch.cat([context, block])[None]
    positions = torch.arange(ids.shape[1])[None]
    mask = to_additive(block_causal_mask(positions, B), torch.float32)
    with torch.no_grad():
        return model(input_ids=ids, position_ids=positions, attention_mask=mask).logits[0, -B:].float()


@pytest.mark.parametrize("layout", ["paired", "stacked"])
@pytest.mark.parametrize("rule", ["sequential", "low_confidence_static"])
@pytest.mark.parametrize("use_cache", [True, False])
def test_verify_logits_equal_separate_forwards_before_each_reveal_step(target, target_1l, drafter, layout, rule,
                                                                       use_cache, monkeypatch):
    """Paired (Eq. 1) is exact on a one-layer target; stacked is exact at any depth (here two layers)."""
    model = target_1l if layout == "paired" else target
    captured = []
    original = SimSDStrategy.verify

    def capture(self, block, drafts, pending):
        logits = original(self, block, drafts, pending)
        captured.append((block.start.clone(), drafts.tokens.clone(), drafts.reveal_step.clone(), logits))
        assert self.session.target.valid.sum(dim=1).tolist() == block.start.tolist()   # only full blocks stored
        return logits

    monkeypatch.setattr(SimSDStrategy, "verify", capture)
    out = _simsd(model, drafter, PROMPT, verify_layout=layout, remasking_strategy=rule, use_cache=use_cache)
    assert len(captured) >= 6
    sequence = out[0]
    worst = 0.0
    for start, tokens, reveal, logits in captured:
        context = sequence[: int(start[0])]
        for k in range(B):
            tau = int(reveal[0, k])
            if tau == 0:
                continue
            state = torch.where(reveal[0] < tau, tokens[0], MASK_ID)
            expected = _plain_block_logits(model, context, state)[k]
            worst = max(worst, float((logits[0, k] - expected).abs().max()))
    assert worst <= 1e-5


def test_paired_layout_is_approximate_beyond_one_layer(target, drafter, monkeypatch):
    """Paper §4.3: on a deeper target the paired mask slots differ from the separate forwards (documented)."""
    captured = []
    original = SimSDStrategy.verify

    def capture(self, block, drafts, pending):
        logits = original(self, block, drafts, pending)
        captured.append((block.start.clone(), drafts.tokens.clone(), drafts.reveal_step.clone(), logits))
        return logits

    monkeypatch.setattr(SimSDStrategy, "verify", capture)
    out = _simsd(target, drafter, PROMPT, remasking_strategy="sequential")
    worst = 0.0
    for start, tokens, reveal, logits in captured:
        for k in range(B):
            tau = int(reveal[0, k])
            if tau > 1:
                state = torch.where(reveal[0] < tau, tokens[0], MASK_ID)
                expected = _plain_block_logits(target, out[0, : int(start[0])], state)[k]
                worst = max(worst, float((logits[0, k] - expected).abs().max()))
    assert worst > 1e-3


def test_compact_paired_layout_keeps_every_mask_slot_logit(target, drafter, monkeypatch):
    """Dropping the tokens nobody needs changes no mask-slot logit, at any depth (two layers here): the compact
    verify equals the full 2B-token paired forward over the same cache."""
    import hf_dllm_spec.strategies.simsd as simsd_module

    def full_layout(ids, positions, reveal_step):
        width = reveal_step.shape[1]
        slot = torch.arange(width, 2 * width)[None].expand(ids.shape[0], -1)
        return ids, positions, temporal_verify_mask(reveal_step), slot

    captured = {}
    original = SimSDStrategy.verify

    def record(key):
        def verify(self, block, drafts, pending):
            logits = original(self, block, drafts, pending)
            captured.setdefault(key, []).append((drafts.reveal_step > 0, logits))
            return logits
        return verify

    ids, mask, _ = left_padded_batch([7, 2, 9], seed=2)
    kwargs = dict(attention_mask=mask, pad_token_id=0, preset="simsd-dynamic")
    monkeypatch.setattr(SimSDStrategy, "verify", record("compact"))
    compact = _simsd(target, drafter, ids, **kwargs)
    monkeypatch.setattr(simsd_module, "compact_paired_layout", full_layout)
    monkeypatch.setattr(SimSDStrategy, "verify", record("full"))
    assert torch.equal(_simsd(target, drafter, ids, **kwargs), compact)
    assert len(captured["compact"]) == len(captured["full"]) >= 6
    for (drafted, a), (_, b) in zip(captured["compact"], captured["full"]):
        torch.testing.assert_close(a[drafted], b[drafted], atol=1e-5, rtol=1e-5)


# -- self-draft and the lossless cases -----------------------------------------------------------------------------
@pytest.mark.parametrize("rule", ["sequential", "low_confidence_static"])
@pytest.mark.parametrize("layout", ["paired", "stacked"])
def test_self_draft_accepts_everything_and_equals_target_block_diffusion(target, target_1l, rule, layout):
    model = target_1l if layout == "paired" else target
    out = _simsd(model, model, PROMPT, verify_layout=layout, remasking_strategy=rule, return_dict_in_generate=True)
    ref = _block_diffusion(model, PROMPT, remasking_strategy=rule)
    assert torch.equal(out.sequences, ref)
    stats = out.spec_stats
    assert stats.acceptance_rate == 1.0 and stats.num_recovered_tokens == 0
    assert stats.num_accepted_tokens == stats.num_committed_tokens


@pytest.mark.parametrize("seed", [7, 11, 13])
def test_sequential_drafter_reproduces_target_sequential_block_diffusion(target, target_1l, seed):
    """Greedy SimSD + greedy_match with a left-to-right drafter == the target's own sequential block diffusion, for
    any drafter (random ones here: most drafts are rejected)."""
    drafter_ = _sdar(seed)
    for model, layout in ((target, "stacked"), (target_1l, "paired")):
        ids, mask, _ = left_padded_batch([7, 3, 9], seed=seed)
        out = _simsd(model, drafter_, ids, attention_mask=mask, pad_token_id=0, verify_layout=layout,
                     remasking_strategy="sequential", return_dict_in_generate=True)
        ref = _block_diffusion(model, ids, attention_mask=mask, pad_token_id=0, remasking_strategy="sequential")
        assert torch.equal(out.sequences, ref)
        assert out.spec_stats.acceptance_rate < 0.9


def test_temporal_order_with_confidence_reveals_self_draft_equals_target_block_diffusion(target):
    """Temporal order leaves gaps in the block (a later position accepted first); self-drafting on the exact layout
    still accepts everything and reproduces the target's static block diffusion."""
    out = _simsd(target, target, PROMPT, verify_order="temporal", verify_layout="stacked",
                 remasking_strategy="low_confidence_static", return_dict_in_generate=True)
    assert torch.equal(out.sequences, _block_diffusion(target, PROMPT, remasking_strategy="low_confidence_static"))
    assert out.spec_stats.acceptance_rate == 1.0


def test_temporal_order_with_a_random_drafter_batches_like_singles(target, drafter):
    ids, mask, prompts = left_padded_batch([7, 2, 9], seed=6)
    kwargs = dict(verify_order="temporal", remasking_strategy="low_confidence_static")
    batch = _simsd(target, drafter, ids, attention_mask=mask, pad_token_id=0, **kwargs)
    for n, prompt in enumerate(prompts):
        new = _simsd(target, drafter, prompt[None], **kwargs)[0, prompt.shape[0]:]
        assert torch.equal(batch[n, ids.shape[1]: ids.shape[1] + new.shape[0]], new)


def test_min_draft_len_lets_the_target_finish_short_remainders(target):
    """Self-draft, static reveals, stacked layout: the target finishing remainders alone still reproduces its own
    static block diffusion. With a random drafter (block-aligned prompt: no tail), blocks with a rejection are
    finished by the target, one token per forward, counted as denoising forwards, not verifications."""
    out = _simsd(target, target, PROMPT, verify_layout="stacked", min_draft_len=B, return_dict_in_generate=True)
    assert torch.equal(out.sequences, _block_diffusion(target, PROMPT, remasking_strategy="low_confidence_static"))
    aligned = PROMPT[:, :4]
    out = _simsd(target, _sdar(11), aligned, min_draft_len=B, return_dict_in_generate=True)
    st = out.spec_stats
    assert st.num_fallback_tokens > 0
    assert st.num_verify_forwards == st.num_drafts
    assert st.num_draft_forwards == st.num_denoising_steps == st.num_draft_model_forwards - 1 + st.num_fallback_tokens
    with pytest.raises(ValueError, match="min_draft_len"):
        _simsd(target, target, PROMPT, min_draft_len=B + 1)


def test_short_budget_and_a_block_aligned_prompt(target, drafter):
    for prompt, budget in ((PROMPT, 3), (PROMPT[:, :4], 2), (PROMPT[:, :2], 5)):
        out = _simsd(target, drafter, prompt, max_new_tokens=budget, preset="simsd-exact")
        ref = _block_diffusion(target, prompt, max_new_tokens=budget, remasking_strategy="sequential")
        assert torch.equal(out, ref) and out.shape[1] == prompt.shape[1] + budget


# -- batches, cache, stats ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("layout", ["paired", "stacked"])
def test_batch_of_4_padded_equals_singles(target, drafter, layout):
    ids, mask, prompts = left_padded_batch([7, 2, 9, 4], seed=3)
    batch = _simsd(target, drafter, ids, attention_mask=mask, pad_token_id=0, verify_layout=layout)
    for n, prompt in enumerate(prompts):
        single = _simsd(target, drafter, prompt[None], verify_layout=layout)
        new = single[0, prompt.shape[0]:]
        assert torch.equal(batch[n, ids.shape[1]: ids.shape[1] + new.shape[0]], new)


def test_batch_rows_stopping_at_different_times_equal_singles(target, drafter):
    ids, mask, prompts = left_padded_batch([7, 2, 9, 4], seed=3)
    free = _simsd(target, drafter, prompts[0][None])[0, prompts[0].shape[0]:]
    stop = int(free[5])                                               # a token the first row emits mid-output
    batch = _simsd(target, drafter, ids, attention_mask=mask, pad_token_id=0, eos_token_id=stop)
    lengths = set()
    for n, prompt in enumerate(prompts):
        new = _simsd(target, drafter, prompt[None], eos_token_id=stop)[0, prompt.shape[0]:]
        lengths.add(new.shape[0])
        assert torch.equal(batch[n, ids.shape[1]: ids.shape[1] + new.shape[0]], new)
    assert len(lengths) > 1


def test_no_cache_equals_cache(target, drafter):
    ids, mask, _ = left_padded_batch([7, 2, 5], seed=5)
    kwargs = dict(attention_mask=mask, pad_token_id=0, remasking_strategy="low_confidence_static")
    assert torch.equal(_simsd(target, drafter, ids, **kwargs), _simsd(target, drafter, ids, use_cache=False, **kwargs))


def test_drafter_cache_holds_only_full_committed_blocks(target, drafter, monkeypatch):
    original = SimSDStrategy.draft
    checked = []

    def check(self, block, pending):
        drafts = original(self, block, pending)
        assert self.session.drafter.valid.sum(dim=1).tolist() == block.start.tolist()
        checked.append(1)
        return drafts

    monkeypatch.setattr(SimSDStrategy, "draft", check)
    _simsd(target, drafter, PROMPT)
    assert len(checked) >= 6


def test_stats_separate_drafter_and_target(target, drafter):
    out = _simsd(target, drafter, PROMPT, return_dict_in_generate=True, max_new_tokens=16)
    st = out.spec_stats
    assert st.num_prefill_forwards == 2                                  # one per model
    assert st.num_draft_model_forwards == st.num_draft_forwards + 1      # drafter denoising + its prefill
    assert st.num_verify_forwards == st.num_drafts                       # one target forward per cycle
    assert st.num_draft_forwards == st.num_denoising_steps
    assert sum(st.accepted_length_histogram.values()) == st.num_drafts
    assert st.num_committed_tokens == st.num_accepted_tokens + st.num_recovered_tokens + st.num_fallback_tokens
    assert st.draft_model_time_s > 0 and st.draft_target_time_ratio > 0


# -- rejection sampling --------------------------------------------------------------------------------------------
def test_output_distribution_identity_float64():
    gen = torch.Generator().manual_seed(0)
    t = torch.rand(50, 13, generator=gen, dtype=torch.float64).softmax(-1)
    d = (3 * torch.rand(50, 13, generator=gen, dtype=torch.float64)).softmax(-1)
    torch.testing.assert_close(verification.output_distribution(t, d), t, atol=1e-15, rtol=0)


ROWS = 3000


def test_sampled_first_token_follows_the_target_and_a_biased_residual_fails(target_1l, monkeypatch):
    """Per-position acceptance (min(1, t/d), residual (t - d)+): the first committed token follows the target's
    distribution at its mask slot; sampling from t instead of the residual is detected."""
    drafter_ = _sdar(5, layers=1)
    prompt = torch.tensor([[3, 5, 2, 7]])                       # block-aligned: position 0 of the block is new
    ids = prompt.expand(ROWS, -1)
    temperature = 0.7
    expected = (_plain_block_logits(target_1l, prompt[0], torch.full((B,), MASK_ID))[0] / temperature)
    expected[MASK_ID] = float("-inf")
    expected = expected.softmax(-1).double()

    def first_tokens():
        out = _simsd(target_1l, drafter_, ids, attention_mask=torch.ones_like(ids), max_new_tokens=1,
                     remasking_strategy="sequential", do_sample=True, temperature=temperature, top_k=0, pad_token_id=0,
                     generator=torch.Generator().manual_seed(0), return_dict_in_generate=True)
        return out.sequences[:, prompt.shape[1]], out.spec_stats

    def pvalue(tokens):
        counts = torch.bincount(tokens, minlength=expected.shape[0]).double()
        keep = expected * ROWS >= 5
        observed = torch.cat([counts[keep], counts[~keep].sum()[None]])
        exp = torch.cat([expected[keep], expected[~keep].sum()[None]]) * ROWS
        return chisquare(observed.numpy(), (exp * observed.sum() / exp.sum()).numpy()).pvalue

    tokens, stats = first_tokens()
    assert 0.05 < stats.acceptance_rate < 0.95
    assert pvalue(tokens) > 1e-3
    monkeypatch.setattr("hf_dllm_spec.maths.verification.residual_distribution", lambda t, d: t)
    biased, _ = first_tokens()
    assert pvalue(biased) < 1e-6


def test_same_seed_same_tokens(target, drafter):
    def run():
        return _simsd(target, drafter, PROMPT, do_sample=True, temperature=0.9, top_k=0,
                      generator=torch.Generator().manual_seed(3))
    assert torch.equal(run(), run())


# -- EOS gate --------------------------------------------------------------------------------------------------------
def test_eos_gate_replaces_an_unlikely_stop_id_arriving_as_the_correction():
    drafts = torch.tensor([[1, 2]])                                     # stop id 0; slot 1 is corrected to 0
    sampler = Sampler([], do_sample=False, suppress_token_ids=[])
    for eos_prob, gate, expected in ((0.45, 0.5, [1, 1]), (0.45, 0.4, [1, 0]), (0.7, 0.5, [1, 0]), (0.7, 0.8, [1, 1])):
        rest = (1 - eos_prob) / 2
        target_probs = torch.tensor([[[0.1, 0.6, 0.3], [eos_prob, rest + 0.01, rest - 0.01]]])
        result = greedy_match(drafts, target_probs, num_drafts=torch.tensor([2]))
        assert result.token_ids[0, :2].tolist() == [1, 0] and bool(result.recovered[0])
        gated = gate_stop_tokens(result.token_ids[:, :2], result, target_probs, [0], gate, sampler)
        assert gated[0].tolist() == expected
    # an accepted draft stop id (not a correction) is never gated
    target_probs = torch.tensor([[[0.1, 0.6, 0.3], [0.3, 0.2, 0.5]]])
    result = greedy_match(torch.tensor([[1, 2]]), target_probs, num_drafts=torch.tensor([2]))
    assert gate_stop_tokens(result.token_ids[:, :2], result, target_probs, [2], 0.9, sampler)[0].tolist() == [1, 2]


def test_eos_gate_replaces_the_correction_end_to_end(target, monkeypatch):
    """A stop id that first arrives as a correction ends the plain run there; the gate (at 1.0) replaces it."""
    import hf_dllm_spec.strategies.simsd as simsd_module

    drafter_ = _sdar(11)
    corrections = []
    original_match = simsd_module.greedy_match

    def spy_match(*args, **kwargs):
        result = original_match(*args, **kwargs)
        if bool(result.recovered[0]):
            corrections.append(int(result.token_ids[0, int(result.num_accepted[0])]))
        return result

    monkeypatch.setattr(simsd_module, "greedy_match", spy_match)
    free = _simsd(target, drafter_, PROMPT)[0, PROMPT.shape[1]:]
    stop = next(c for c in corrections if c not in free[: free.tolist().index(c)].tolist())
    gated_calls = []
    original_gate = simsd_module.gate_stop_tokens

    def spy_gate(committed, *args, **kwargs):
        out = original_gate(committed, *args, **kwargs)
        gated_calls.append(not torch.equal(out, committed))
        return out

    monkeypatch.setattr(simsd_module, "gate_stop_tokens", spy_gate)
    plain = _simsd(target, drafter_, PROMPT, eos_token_id=stop)
    gated = _simsd(target, drafter_, PROMPT, eos_token_id=stop, eos_min_prob=1.0)
    assert plain[0, -1] == stop and any(gated_calls)
    assert not torch.equal(plain, gated[:, : plain.shape[1]])


# -- bad input --------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("field,value", [("verify_layout", "tree"), ("verify_order", "random"), ("min_draft_len", 0),
                                         ("eos_min_prob", 1.5), ("cache_ver", True), ("sub_block_size", 2),
                                         ("acceptance", "typical"), ("fuse_cache_write", False)])
def test_config_validation_names_the_parameter(field, value):
    with pytest.raises(ValueError, match=field):
        SimSDConfig(**{field: value}).validate()


def test_pairs_are_checked_before_any_forward(target, drafter, qwen_model):
    with pytest.raises(ValueError, match="draft_model"):
        target.generate(PROMPT, decoding_strategy="simsd", max_new_tokens=4)
    with pytest.raises(ValueError, match="draft_model"):
        _simsd(target, qwen_model, PROMPT)                      # not a diffusion LM of the family
    other_vocab = _sdar(2, vocab_size=120)
    with pytest.raises(ValueError, match="draft_model"):
        _simsd(target, other_vocab, PROMPT)
    with pytest.raises(ValueError, match="draft_block_size"):
        _simsd(target, drafter, PROMPT, draft_block_size=8)
    with pytest.raises(ValueError, match="acceptance"):
        _simsd(target, drafter, PROMPT, acceptance="greedy_match", do_sample=True)


# -- a right-shifted family (Fast-dLLM v2): the stacked layout carries over ----------------------------------------
def _fast_dllm(seed: int):
    from model_patches.fast_dllm_v2 import Fast_dLLM_QwenConfig, Fast_dLLM_QwenForCausalLM

    torch.manual_seed(seed)
    config = Fast_dLLM_QwenConfig(initializer_range=0.2, bd_size=B, mask_token_id=MASK_ID, tie_word_embeddings=True,
                                  eos_token_id=None, attn_implementation="sdpa", vocab_size=99, hidden_size=32,
                                  intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=2)
    return Fast_dLLM_QwenForCausalLM(config).eval()


def test_right_shifted_family_runs_exactly_on_the_stacked_layout():
    target_, drafter_ = _fast_dllm(0), _fast_dllm(5)
    for prompt in (PROMPT, PROMPT[:, :4]):                  # a prompt tail in the first block, and none
        out = _simsd(target_, drafter_, prompt, preset="simsd-exact", return_dict_in_generate=True)
        ref = _block_diffusion(target_, prompt, remasking_strategy="sequential")
        assert torch.equal(out.sequences, ref) and out.spec_stats.acceptance_rate < 0.9
        self_draft = _simsd(target_, target_, prompt, verify_layout="stacked",
                            remasking_strategy="low_confidence_static", return_dict_in_generate=True)
        assert torch.equal(self_draft.sequences, _block_diffusion(target_, prompt,
                                                                  remasking_strategy="low_confidence_static"))
        assert self_draft.spec_stats.acceptance_rate == 1.0
    ids, mask, prompts = left_padded_batch([7, 2, 9, 4], seed=8)
    batch = _simsd(target_, drafter_, ids, attention_mask=mask, pad_token_id=0, preset="simsd-exact")
    for n, prompt in enumerate(prompts):
        new = _simsd(target_, drafter_, prompt[None], preset="simsd-exact")[0, prompt.shape[0]:]
        assert torch.equal(batch[n, ids.shape[1]: ids.shape[1] + new.shape[0]], new)
    with pytest.raises(ValueError, match="verify_layout"):
        _simsd(target_, drafter_, PROMPT)                   # the paired layout does not carry over
    with pytest.raises(ValueError, match="draft_model"):
        _simsd(target_, _sdar(7), PROMPT, verify_layout="stacked")      # another family
