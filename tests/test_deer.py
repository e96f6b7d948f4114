"""DEER (arXiv 2512.15176): a one-forward diffusion drafter, an AR target, lossless verification.

Tiny random pairs built from config (Qwen2 and Qwen3 targets, an SDAR drafter): greedy DEER equals the
target's own greedy `generate`; sampled DEER follows the target's distribution (chi-square, with a negative
control); the target cache equals a fresh prefill after every cycle; the drafter's cached prefix equals a
fresh forward; both integration paths agree; batches equal singles.
"""

from __future__ import annotations

import pytest
import torch
from conftest import MASK_ID, TINY, left_padded_batch
from scipy.stats import chisquare
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

import hf_dllm_spec
from hf_dllm_spec.maths import verification
from hf_dllm_spec.strategies.drafting import OneStepDrafter, draft_block_layout
from hf_dllm_spec.maths.masks import full_mask, to_additive
from hf_dllm_spec.outputs import BatchStats
from hf_dllm_spec.runtime.runner import ModelRunner
from hf_dllm_spec.strategies.deer import DeerConfig, DeerStrategy
from model_patches import get_patch
from model_patches.compat import output_cache
from model_patches.sdar import SDARConfig, SDARForCausalLM

PROMPT = torch.tensor([[5, 17, 42, 8, 23, 61, 4]])


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _target(kind: str, seed: int = 1, **overrides):
    torch.manual_seed(seed)
    config = {**TINY, **overrides}
    if kind == "qwen2":
        return Qwen2ForCausalLM(Qwen2Config(**{k: v for k, v in config.items() if k != "head_dim"})).eval()
    if kind == "llama":
        return LlamaForCausalLM(LlamaConfig(**config)).eval()
    return Qwen3ForCausalLM(Qwen3Config(**config)).eval()


@pytest.fixture(scope="module")
def drafter():
    torch.manual_seed(7)
    return SDARForCausalLM(SDARConfig(block_size=4, mask_token_id=MASK_ID, **TINY)).eval()


def _deer(target, drafter, ids, **kwargs):
    kwargs.setdefault("max_new_tokens", 24)
    return target.generate(ids, custom_generate=hf_dllm_spec.custom_generate, decoding_strategy="deer",
                           draft_model=drafter, **kwargs)


def _greedy(target, ids, **kwargs):
    kwargs.setdefault("max_new_tokens", 24)
    return target.generate(ids, do_sample=False, **kwargs)


# -- greedy DEER == the target's greedy generate ------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["qwen2", "qwen3", "llama"])
@pytest.mark.parametrize("k", [1, 4, 16])
def test_greedy_deer_equals_target_greedy(drafter, kind, k):
    target = _target(kind)
    out = _deer(target, drafter, PROMPT, block_size=k, return_dict_in_generate=True)
    assert torch.equal(out.sequences, _greedy(target, PROMPT))
    stats = out.spec_stats
    assert stats.num_committed_tokens == (stats.num_accepted_tokens + stats.num_recovered_tokens
                                          + stats.num_bonus_tokens + stats.num_fallback_tokens)
    # one drafter forward per cycle with drafts; a cycle one token short of the budget is a plain AR step
    assert stats.num_draft_forwards == stats.num_drafts
    assert stats.num_verify_forwards == stats.num_drafts + stats.num_fallback_tokens
    assert 0 < stats.draft_model_time_s < stats.forward_time_s


@pytest.mark.parametrize("draft_attention", ["causal_prefix", "full"])
def test_random_drafter_is_mostly_rejected_yet_exact(drafter, draft_attention):
    """A random drafter is nearly always wrong: acceptance is low, but the output is still the target's."""
    target = _target("qwen3", seed=3)
    out = _deer(target, drafter, PROMPT, block_size=8, draft_attention=draft_attention, return_dict_in_generate=True)
    assert torch.equal(out.sequences, _greedy(target, PROMPT))
    assert out.spec_stats.acceptance_rate < 0.5


def test_k1_with_a_perfect_drafter_degenerates_to_ar():
    # The AR target itself as a right-shifted 'diffusion' drafter: its single mask is scored from the last prefix
    # token, i.e. exactly the target's next-token distribution (a perfect drafter at k = 1).
    target = _target("qwen2", seed=4)
    out = _deer(target, target, PROMPT, block_size=1, draft_mask_token_id=MASK_ID,
                return_dict_in_generate=True)
    assert torch.equal(out.sequences, _greedy(target, PROMPT))
    stats = out.spec_stats
    assert stats.acceptance_rate == 1.0                   # every draft is the target's argmax
    assert stats.num_bonus_tokens == stats.num_drafts     # and every cycle ends with a bonus token
    assert stats.mean_acceptance_length == 2.0


def test_stop_id_ends_the_output_exactly(drafter):
    target = _target("qwen2")
    ref = _greedy(target, PROMPT)
    eos = int(ref[0, PROMPT.shape[1] + 5])                # the 6th generated token becomes the stop id
    ref_eos = _greedy(target, PROMPT, eos_token_id=eos, pad_token_id=0)
    out = _deer(target, drafter, PROMPT, block_size=16, eos_token_id=eos, pad_token_id=0)
    assert torch.equal(out, ref_eos)
    assert int(out[0, -1]) == eos and int((out[0, PROMPT.shape[1]:] == eos).sum()) == 1


def test_budget_is_exact_and_never_overdrafted(drafter):
    target = _target("qwen2")
    for budget in (1, 2, 5, 17):
        out = _deer(target, drafter, PROMPT, block_size=16, max_new_tokens=budget, return_dict_in_generate=True)
        assert torch.equal(out.sequences, _greedy(target, PROMPT, max_new_tokens=budget))
        assert out.spec_stats.num_discarded_tokens == 0   # drafts are capped by the remaining budget


def test_batch_of_4_padded_equals_singles(drafter):
    target = _target("qwen3")
    ids, mask, prompts = left_padded_batch([3, 9, 1, 6], seed=2)
    batch = _deer(target, drafter, ids, attention_mask=mask, block_size=4, pad_token_id=0)
    for n, p in enumerate(prompts):
        single = _deer(target, drafter, p[None], block_size=4)
        assert torch.equal(batch[n, ids.shape[1]:ids.shape[1] + 24], single[0, p.shape[0]:]), n


def test_no_cache_equals_cache(drafter):
    target = _target("qwen2")
    cached = _deer(target, drafter, PROMPT, block_size=4, do_sample=True, generator=torch.Generator().manual_seed(0))
    uncached = _deer(target, drafter, PROMPT, block_size=4, do_sample=True, use_cache=False,
                     generator=torch.Generator().manual_seed(0))
    assert torch.equal(cached, uncached)


# -- the target cache after every cycle == a fresh prefill of the committed tokens -------------------------------
def test_target_cache_equals_fresh_prefill_after_every_cycle(drafter, monkeypatch):
    target = _target("qwen2")
    ids, mask, prompts = left_padded_batch([5, 2, 8], seed=4)
    checked = []
    original = DeerStrategy.finish_rows

    def check(self, committed, committed_ids):
        runner = self.session.target
        for i, prompt_index in enumerate(self.session.stats.active):
            # committed so far, minus the last token (the next cycle feeds it with the drafts)
            tokens = torch.cat([prompts[prompt_index], self.generated[prompt_index], committed[i]])[:-1]
            fresh = output_cache(target(tokens[None], use_cache=True))
            for layer, fresh_layer in zip(runner.cache.layers, fresh.layers):
                kept = layer.keys[i][:, runner.valid[i]]
                torch.testing.assert_close(kept, fresh_layer.keys[0], atol=1e-5, rtol=1e-5)
                torch.testing.assert_close(layer.values[i][:, runner.valid[i]], fresh_layer.values[0], atol=1e-5,
                                           rtol=1e-5)
        checked.append(len(committed))
        return original(self, committed, committed_ids)

    monkeypatch.setattr(DeerStrategy, "finish_rows", check)
    _deer(target, drafter, ids, attention_mask=mask, block_size=4, pad_token_id=0, max_new_tokens=20)
    assert len(checked) >= 5


# -- the drafter ----------------------------------------------------------------------------------------------------
def test_cached_drafter_prefix_equals_a_fresh_forward(drafter):
    """Feeding the prefix in pieces through the cache gives the logits of one forward over `[prefix | MASK x k]`."""
    k = 4
    prefix = torch.tensor([5, 17, 42, 8, 23, 61, 4, 9, 33])
    incremental = OneStepDrafter(ModelRunner(drafter, get_patch(drafter), BatchStats(1), batch_size=1), MASK_ID)
    for piece in (prefix[:4], prefix[4:5], prefix[5:]):
        logits = incremental.draft([piece], k)
    fresh = OneStepDrafter(ModelRunner(drafter, get_patch(drafter), BatchStats(1), batch_size=1), MASK_ID)
    torch.testing.assert_close(logits, fresh.draft([prefix], k), atol=1e-5, rtol=1e-5)
    # and the layout: causal prefix, full-attention masked block, by a plain forward with that mask
    n = prefix.shape[0]
    allowed = torch.ones(n + k, n + k, dtype=torch.bool).tril()
    allowed[n:, :] = True
    ids = torch.cat([prefix, torch.full((k,), MASK_ID)])[None]
    ref = drafter(input_ids=ids, position_ids=torch.arange(n + k)[None],
                  attention_mask=to_additive(allowed[None], torch.float32)).logits[:, n:]
    torch.testing.assert_close(logits, ref, atol=1e-5, rtol=1e-5)


def test_full_attention_drafter_is_a_bidirectional_forward(drafter):
    k, prefix = 3, torch.tensor([5, 17, 42, 8])
    full = OneStepDrafter(ModelRunner(drafter, get_patch(drafter), BatchStats(1), batch_size=1), MASK_ID,
                          draft_attention="full")
    full.draft([prefix[:2]], k)
    logits = full.draft([prefix[2:]], k)
    ids = torch.cat([prefix, torch.full((k,), MASK_ID)])[None]
    ref = drafter(input_ids=ids, position_ids=torch.arange(7)[None],
                  attention_mask=to_additive(full_mask(7)[None], torch.float32)).logits[:, 4:]
    torch.testing.assert_close(logits, ref, atol=1e-5, rtol=1e-5)


def test_right_shifted_drafter_scores_the_first_draft_from_the_last_prefix_token():
    model = _target("qwen2", seed=5)
    drafter_ = OneStepDrafter(ModelRunner(model, get_patch(model), BatchStats(1), batch_size=1), MASK_ID)
    logits = drafter_.draft([PROMPT[0]], 1)
    torch.testing.assert_close(logits[:, 0], model(PROMPT).logits[:, -1], atol=1e-5, rtol=1e-5)


def test_sep_layout():
    assert draft_block_layout(3, 9, None, "after_masks") == ([9, 9, 9], [0, 1, 2], [0, 1, 2])
    assert draft_block_layout(3, 9, 7, "after_masks") == ([9, 9, 9, 7], [0, 1, 2, 3], [0, 1, 2])
    assert draft_block_layout(3, 9, 7, "before_masks") == ([7, 9, 9, 9], [0, 0, 1, 2], [1, 2, 3])


def test_sep_token_runs_and_stays_exact(drafter):
    target = _target("qwen2")
    for position in ("after_masks", "before_masks"):
        out = _deer(target, drafter, PROMPT, block_size=4, sep_token_id=3, sep_position=position)
        assert torch.equal(out, _greedy(target, PROMPT))


# -- both integration paths ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("k", [1, 4, 16])
def test_candidate_generator_path_equals_strategy_path(drafter, k):
    target = _target("qwen3")
    assisted = hf_dllm_spec.deer_assisted_generate(target, PROMPT, drafter, num_draft_tokens=k, max_new_tokens=24,
                                                   do_sample=False)
    strategy = _deer(target, drafter, PROMPT, block_size=k)
    assert torch.equal(assisted, strategy)
    assert torch.equal(assisted, _greedy(target, PROMPT))
    assert target.last_deer_candidate_generator.stats.total().num_draft_forwards >= 1
    assert not hasattr(type(target), "last_deer_candidate_generator")
    assert "_get_candidate_generator" not in vars(target)      # the hook is removed after the call


def test_candidate_generator_calls_on_one_target_in_two_threads_keep_their_own_drafter(drafter, monkeypatch):
    """Two threads assisting one target with different settings: each builds its candidate generators with its own
    `num_draft_tokens` and gets the target's greedy tokens. The hook was one instance attribute: a thread built the
    other's generator, and the first to finish deleted it under the other (`AttributeError`)."""
    import threading

    from hf_dllm_spec.integration.candidate_generator import DeerCandidateGenerator

    target = _target("qwen3")
    expected = _greedy(target, PROMPT)
    built: dict[int, set[int]] = {}
    init = DeerCandidateGenerator.__init__

    def recording_init(self, *args, num_draft_tokens, **kwargs):
        built.setdefault(threading.get_ident(), set()).add(num_draft_tokens)
        init(self, *args, num_draft_tokens=num_draft_tokens, **kwargs)

    monkeypatch.setattr(DeerCandidateGenerator, "__init__", recording_init)
    barrier, results = threading.Barrier(2), {}

    def run(k: int) -> None:
        barrier.wait()
        try:
            results[k] = [hf_dllm_spec.deer_assisted_generate(target, PROMPT, drafter, num_draft_tokens=k,
                                                              max_new_tokens=24, do_sample=False) for _ in range(4)]
        except Exception as err:                    # noqa: BLE001 - reported below
            results[k] = err

    threads = [threading.Thread(target=run, args=(k,)) for k in (2, 5)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for k in (2, 5):
        assert not isinstance(results[k], Exception), results[k]
        assert all(torch.equal(out, expected) for out in results[k])
    assert sorted(map(sorted, built.values())) == [[2], [5]]             # each thread its own generators only
    assert "_get_candidate_generator" not in vars(target)


def test_the_candidate_hook_nests_and_leaves_other_threads_to_transformers(monkeypatch):
    """Nested DEER calls on one target each get their own factory and the hook goes with the last; a thread
    without a DEER call (another thread's plain assisted `generate`) gets transformers' own method."""
    import threading

    from hf_dllm_spec.integration.candidate_generator import _candidate_generator

    target = _target("qwen3")
    monkeypatch.setattr(type(target), "_get_candidate_generator", lambda self, *args, **kwargs: "stock",
                        raising=False)
    seen = []
    with _candidate_generator(target, lambda *args, **kwargs: "f1"):
        with _candidate_generator(target, lambda *args, **kwargs: "f2"):
            assert target._get_candidate_generator() == "f2"
        assert target._get_candidate_generator() == "f1"
        thread = threading.Thread(target=lambda: seen.append(target._get_candidate_generator()))
        thread.start()
        thread.join()
    assert seen == ["stock"] and "_get_candidate_generator" not in vars(target)


def test_candidate_generator_sampling_runs_in_transformers(drafter):
    """Sampled assisted decoding through transformers (which draws from torch's global RNG): the prompt kept, the
    same seed gives the same tokens, another seed others."""
    target = _target("qwen2")

    def sample(seed: int) -> torch.Tensor:
        torch.manual_seed(seed)
        return hf_dllm_spec.deer_assisted_generate(target, PROMPT, drafter, num_draft_tokens=4, max_new_tokens=12,
                                                   do_sample=True, temperature=0.8, top_k=20)

    out = sample(0)
    assert out.shape == (1, PROMPT.shape[1] + 12) and torch.equal(out[:, :PROMPT.shape[1]], PROMPT)
    assert torch.equal(sample(0), out) and not torch.equal(sample(1), out)


# -- sampling losslessness ----------------------------------------------------------------------------------------
SMALL = dict(TINY, vocab_size=12, initializer_range=0.08)
ROWS = 12_000


def _small_pair():
    torch.manual_seed(11)
    target = Qwen2ForCausalLM(Qwen2Config(**{k: v for k, v in SMALL.items() if k != "head_dim"})).eval()
    torch.manual_seed(12)
    drafter_ = SDARForCausalLM(SDARConfig(block_size=4, mask_token_id=11, **SMALL)).eval()
    return target, drafter_


def _joint_counts(out, prompt_len, vocab):
    first, second = out[:, prompt_len], out[:, prompt_len + 1]
    return torch.bincount(first * vocab + second, minlength=vocab * vocab).double()


def _target_joint(target, prompt, vocab):
    """Exact p(x1, x2 | prompt) of the target at temperature 0.7."""
    with torch.no_grad():
        p1 = torch.softmax(target(prompt).logits[0, -1].double() / 0.7, -1)
        seconds = torch.cat([prompt.expand(vocab, -1), torch.arange(vocab)[:, None]], dim=1)
        p2 = torch.softmax(target(seconds).logits[:, -1].double() / 0.7, -1)
    return (p1[:, None] * p2).reshape(-1)


def _pvalue(counts, probs):
    keep = probs * counts.sum() >= 5            # chi-square cells with enough expected mass; the rest pooled
    observed, expected = counts[keep], probs[keep] * counts.sum()
    if not bool(keep.all()):
        observed = torch.cat([observed, counts[~keep].sum()[None]])
        expected = torch.cat([expected, (probs[~keep].sum() * counts.sum())[None]])
    return chisquare(observed.numpy(), (expected * observed.sum() / expected.sum()).numpy()).pvalue


def test_sampled_deer_follows_the_target_and_a_biased_residual_fails(monkeypatch):
    target, drafter_ = _small_pair()
    prompt = torch.tensor([[3, 5, 2, 7]])
    vocab = SMALL["vocab_size"]
    ids = prompt.expand(ROWS, -1)

    def run(seed):
        out = _deer(target, drafter_, ids, attention_mask=torch.ones_like(ids), block_size=4, max_new_tokens=2,
                    do_sample=True, temperature=0.7, pad_token_id=0, generator=torch.Generator().manual_seed(seed),
                    return_dict_in_generate=True)
        return out.sequences, out.spec_stats

    sequences, stats = run(0)
    assert 0.05 < stats.acceptance_rate < 0.95          # both acceptance and rejection are exercised
    expected = _target_joint(target, prompt, vocab)
    assert _pvalue(_joint_counts(sequences, 4, vocab), expected) > 1e-3
    # Negative control: after a rejection, sample from the target instead of the residual (DEER Alg. 1 line 10).
    monkeypatch.setattr(verification, "residual_distribution", lambda t, d: t)
    biased, _ = run(0)
    assert _pvalue(_joint_counts(biased, 4, vocab), expected) < 1e-6


def test_same_seed_same_tokens(drafter):
    target = _target("qwen2")
    runs = [_deer(target, drafter, PROMPT, block_size=4, do_sample=True, generator=torch.Generator().manual_seed(3))
            for _ in range(2)]
    assert torch.equal(*runs)


# -- bad input ----------------------------------------------------------------------------------------------------
def test_diffusion_target_is_refused(drafter, sdar_model):
    with pytest.raises(ValueError, match="`model`.*autoregressive"):
        _deer(sdar_model, drafter, PROMPT)


def test_a_diffusion_target_of_transformers_assisted_decoding_is_refused_as_deer_refuses_it(drafter, sdar_model):
    """`deer_assisted_generate` checks the target against DEER's declared kind, as `generate` does (the diffusion
    target's own `generate` refused the drafter for its native strategy before: a message about another strategy)."""
    with pytest.raises(ValueError, match=r"^`model` \(='SDARForCausalLM'\) must be an autoregressive causal LM "
                                         r"\(right-shifted, not a diffusion LM; e.g. Qwen2/Qwen3\) for "
                                         r"decoding_strategy='deer'"):
        hf_dllm_spec.deer_assisted_generate(sdar_model, PROMPT, drafter, num_draft_tokens=4, max_new_tokens=8)


def test_drafter_is_required_and_needs_a_mask_token(drafter):
    target = _target("qwen2")
    with pytest.raises(ValueError, match="draft_model"):
        target.generate(PROMPT, custom_generate=hf_dllm_spec.custom_generate, decoding_strategy="deer")
    with pytest.raises(ValueError, match="draft_mask_token_id"):
        _deer(target, _target("qwen3"), PROMPT)


def test_greedy_match_with_sampling_is_refused(drafter):
    with pytest.raises(ValueError, match="acceptance"):
        _deer(_target("qwen2"), drafter, PROMPT, acceptance="greedy_match", do_sample=True)


def test_prompt_with_the_drafter_mask_is_refused(drafter):
    with pytest.raises(ValueError, match="drafter's mask token"):
        _deer(_target("qwen2"), drafter, torch.tensor([[5, MASK_ID, 7]]))


@pytest.mark.parametrize("field, value", [("block_size", 0), ("acceptance", "typical"), ("draft_attention", "causal"),
                                          ("sep_position", "middle"), ("sep_token_id", -1)])
def test_config_validation_names_the_parameter(field, value):
    with pytest.raises(ValueError, match=field):
        DeerConfig(**{field: value})


def test_candidate_generator_refuses_batches(drafter):
    generator = hf_dllm_spec.DeerCandidateGenerator(drafter, num_draft_tokens=4)
    with pytest.raises(ValueError, match="input_ids"):
        generator.get_candidates(PROMPT.expand(2, -1))
    with pytest.raises(ValueError, match="num_draft_tokens"):
        hf_dllm_spec.DeerCandidateGenerator(drafter, num_draft_tokens=0)
