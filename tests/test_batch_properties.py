"""Property: a random left-padded batch decodes every row exactly as that prompt decodes alone (greedy, fp32).

Random batches of 1-4 prompts of 1-10 tokens, random block sizes and budgets, and a stop id taken from a row's own
output at a random step, so that rows end anywhere, also before their first block reaches the KV cache (the case
that crashed transformers' cache update: a row left while the cache was still empty). Every strategy on every
family (the cases of tests/random_batches.py). 20 batches per strategy in the fast suite, 100 in the full suite.
A failure that float64 does not reproduce is a float32 tie, not a decoding bug (`TIE_CASE` below, once recorded as a
block size 1 bug; tests/random_batches.py).
"""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from random_batches import (CASES, MODELS, PAD, assume_it_fits, batches, check_or_tie, generate, left_padded,
                            stop_id)

from hf_dllm_spec.maths.sampling import Sampler


def _check(name: str, case, models: dict = MODELS) -> None:
    prompts, params, budget, _ = case
    assume_it_fits(name, prompts, params, budget)
    eos = stop_id(name, case, models)
    singles = [generate(name, torch.tensor([p]), None, params, budget, eos, models)[0, len(p):] for p in prompts]
    width = max(len(p) for p in prompts)
    out = generate(name, *left_padded(prompts), params, budget, eos, models, return_dict_in_generate=True)
    for i, single in enumerate(singles):
        row = out.sequences[i, width:]
        assert row[: single.shape[0]].tolist() == single.tolist(), f"row {i} of {prompts}"
        assert (row[single.shape[0]:] == PAD).all()
        s = out.spec_stats_per_row[i]                 # each row's counters add up, whenever it left the batch
        assert s.num_generated_tokens == single.shape[0], f"row {i} of {prompts}"
        assert s.num_committed_tokens == s.num_generated_tokens + s.num_discarded_tokens, f"row {i} of {prompts}"
        assert s.num_committed_tokens == (s.num_fallback_tokens + s.num_accepted_tokens + s.num_recovered_tokens
                                          + s.num_bonus_tokens), f"row {i} of {prompts}: {s}"


def _property(name: str, examples: int):
    @settings(max_examples=examples, deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much])
    @given(case=batches(name))
    def run(case):
        check_or_tie(_check, name, case)

    return run


@pytest.mark.parametrize("name", list(CASES))
def test_batch_equals_one_by_one(name, one_thread):
    _property(name, 20)()


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_batch_equals_one_by_one_many(name, one_thread):
    _property(name, 60)()


#: The batch the property once failed on (a strict xfail, "block_diffusion at block size 1 with the KV cache decodes a
#: shorter left-padded row differently"): row 1's first denoising step scores tokens 7 and 52 one float32 ulp apart.
TIE_CASE = ([[2, 2, 2], [79, 65]], {"block_size": 1, "remasking_strategy": "low_confidence_static"}, 3, None)


@pytest.mark.parametrize("name", ["block_diffusion_static", "ar"])
@pytest.mark.parametrize("fuse_cache_write", [True, False])
@pytest.mark.parametrize("use_cache", [True, False])
def test_block_size_1_batch_equals_one_by_one_in_float64(name, fuse_cache_write, use_cache, one_thread):
    """Block size 1, a left-padded batch, cached or not, fused writes or not: exact (float64) batch == one by one.

    The cause of the former xfail: not the cache, the padding or block size 1, but a float32 tie (see
    :func:`test_block_size_1_tie_is_float32_rounding`); in float64 the same batch equals its rows decoded alone.
    """
    prompts, params, budget, stop = TIE_CASE
    params = dict(params, fuse_cache_write=fuse_cache_write, use_cache=use_cache)
    if name == "ar":
        params.pop("remasking_strategy")
    _check(name, (prompts, params, budget, stop), {"sdar": copy.deepcopy(MODELS["sdar"]).double()})


def test_block_size_1_tie_is_float32_rounding(monkeypatch, one_thread):
    """In float32 the padded, cached batch scores row 1's first step within rounding of the single decode, and that
    step's two best tokens are a tie at float32 precision: which one greedy takes depends on the rounding of the
    batch's shapes (padding column, batched matmuls), not on the decoding; no batch layout can be bit-identical."""
    seen = []
    greedy = Sampler.greedy
    monkeypatch.setattr(Sampler, "greedy", lambda self, logits: seen.append(logits.clone()) or greedy(self, logits))
    prompts, params, budget, _ = TIE_CASE
    generate("block_diffusion_static", torch.tensor([prompts[1]]), None, params, 1, None)
    single = seen[0][0, 0]
    seen.clear()
    ids, mask = torch.tensor([[2, 2, 2], [PAD, 79, 65]]), torch.tensor([[1, 1, 1], [0, 1, 1]])
    generate("block_diffusion_static", ids, mask, params, 1, None)
    batched = seen[0][1, 0]
    torch.testing.assert_close(batched, single, rtol=0, atol=1e-5)          # the cache and padding are exact
    top = single.topk(2)
    assert sorted(top.indices.tolist()) == [7, 52] and float(top.values[0] - top.values[1]) < 1e-6    # the tie


def test_check_or_tie_forgives_one_float32_mismatch_per_case_name(monkeypatch):
    """A bug of float32 alone (every float32 check fails, every float64 one passes) fails at its second case: only a
    rare mismatch is taken for a tie."""
    import random_batches

    monkeypatch.setattr(random_batches, "_TIES", set())

    def float32_bug(name, case, models):
        assert next(iter(models.values())).dtype != torch.float32, "float32 differs"

    with pytest.warns(UserWarning, match="taken as a tie"):
        check_or_tie(float32_bug, "ar", "first case")
    with pytest.raises(AssertionError, match="a second float32 mismatch of 'ar' in this process: not a tie"):
        check_or_tie(float32_bug, "ar", "second case")
    with pytest.warns(UserWarning, match="taken as a tie"):
        check_or_tie(float32_bug, "deer", "another case name")
