"""Batches: left-padded prompts of different lengths decode exactly as the same prompts one at a time.

Greedy, fp32, CPU, on the tiny SDAR model (and the bundled model in test_bundled_model.py). Every row keeps its
own block grid, routing state and stop; statistics of the batch are the sums of the singles'.
"""

from __future__ import annotations

import pathlib
from dataclasses import fields

import pytest
import torch
from conftest import gen, left_padded_batch

from hf_dllm_spec import SpecDecodingStats

#: Lengths cover a prompt shorter than a block, exactly one block, a tail of 3 and several blocks.
LENGTHS = [1, 3, 4, 5, 7, 8, 11, 13]
COMMON = dict(eos_token_id=None,        # no stop id: every row decodes its whole budget ...
              pad_token_id=0,           # ... except where a stop id is given below; pads finished rows
              max_new_tokens=14,        # not a multiple of 4 or 16: the last block is trimmed
              return_dict_in_generate=True)
TIMES_AND_CALLS = {"wall_time_s", "prefill_time_s", "forward_time_s", "num_forward_calls"}


@pytest.fixture(scope="module")
def batch():
    """8 prompts of different lengths, left-padded with 0, and the unpadded prompts."""
    return left_padded_batch(LENGTHS)


def counters(stats: SpecDecodingStats) -> dict:
    return {f.name: getattr(stats, f.name) for f in fields(stats) if f.name not in TIMES_AND_CALLS}


def assert_batch_equals_singles(model, batch, **kwargs):
    """The batch's rows, padding and per-row counters equal each prompt decoded alone (`kwargs` over `COMMON`)."""
    ids, mask, prompts = batch
    kwargs = {**COMMON, **kwargs}
    out = model.generate(ids, attention_mask=mask, **kwargs)
    singles = [model.generate(p[None], **kwargs) for p in prompts]
    width = ids.shape[1]
    for i, (p, single) in enumerate(zip(prompts, singles)):
        new = single.sequences[0, len(p):].tolist()
        assert out.sequences[i, width:width + len(new)].tolist() == new, f"row {i} (prompt of {len(p)} tokens)"
        assert (out.sequences[i, width + len(new):] == COMMON["pad_token_id"]).all()
        assert counters(out.spec_stats_per_row[i]) == counters(single.spec_stats), f"row {i} statistics"
    summed = SpecDecodingStats()
    for single in singles:
        summed.merge(single.spec_stats)
    assert counters(out.spec_stats) == counters(summed)
    # One forward call serves the whole batch: far fewer calls than the singles together.
    assert out.spec_stats.num_forward_calls < summed.num_forward_calls
    return out, singles


@pytest.mark.parametrize("strategy,kwargs", [
    ("ar", {}),
    ("block_diffusion", {"block_size": 4, "remasking_strategy": "low_confidence_static"}),
    ("block_diffusion", {"block_size": 4, "confidence_threshold": 0.5}),
    ("block_diffusion", {"block_size": 16, "remasking_strategy": "low_confidence_static"}),
    ("block_diffusion", {"block_size": 16, "confidence_threshold": 0.5}),
    ("block_diffusion", {"block_size": 4, "remasking_strategy": "entropy_bounded", "steps_per_block": 2}),
])
@pytest.mark.filterwarnings("ignore:`block_size`")
def test_block_diffusion_and_ar_batch_equals_singles(sdar_model, batch, strategy, kwargs):
    assert_batch_equals_singles(sdar_model, batch, decoding_strategy=strategy, **kwargs)


S2D2_POLICIES = [
    {"do_verify_policy": "mask_span_length", "min_ssd_span_length": 1},
    {"do_verify_policy": "mask_span_length", "min_ssd_span_length": 2},
    {"do_verify_policy": "score_threshold", "token_acceptance_estimator": "soft_entropy_negexp"},
    {"do_verify_policy": "score_hysteresis", "hysteresis_threshold_on": 0.5, "hysteresis_threshold_off": -0.5},
    {"do_verify_policy": "contextual_bandit_ucb"},
]


@pytest.mark.parametrize("policy", S2D2_POLICIES, ids=lambda p: "-".join(str(v) for v in p.values()))
@pytest.mark.parametrize("ar_caching", [False, True], ids=["block-causal", "cache_ver+draft_ver"])
@pytest.mark.filterwarnings("ignore:`block_size`")
def test_s2d2_batch_equals_singles(sdar_model, batch, policy, ar_caching):
    out, _ = assert_batch_equals_singles(sdar_model, batch, decoding_strategy="s2d2", block_size=4,
                                         cache_ver=ar_caching, draft_ver=ar_caching, **policy)
    if policy["do_verify_policy"] == "mask_span_length":
        assert out.spec_stats.num_verify_forwards > 0


@pytest.mark.parametrize("policy", S2D2_POLICIES[3:], ids=lambda p: p["do_verify_policy"])
@pytest.mark.filterwarnings("ignore:`block_size`")
def test_s2d2_routing_states_follow_their_rows_when_rows_leave(sdar_model, batch, policy):
    """Rows that end at their own stop id leave the batch; a stateful routing policy's per-row state (hysteresis,
    the bandit's statistics) must leave with them, or the rows after them route with another row's state."""
    ids, mask, _ = batch
    kwargs = dict(decoding_strategy="s2d2", block_size=4, **policy)
    free = sdar_model.generate(ids, attention_mask=mask, **COMMON, **kwargs)
    stop = int(free.sequences[2, ids.shape[1] + 5])                  # a token row 2 emits mid-way
    out, _ = assert_batch_equals_singles(sdar_model, batch, **kwargs, eos_token_id=stop)
    lengths = [row.num_generated_tokens for row in out.spec_stats_per_row]
    assert min(lengths) < COMMON["max_new_tokens"] and len(set(lengths)) > 1      # rows left at different steps


@pytest.mark.filterwarnings("ignore:`block_size`")
def test_s2d2_block_16_batch_equals_singles(sdar_model, batch):
    assert_batch_equals_singles(sdar_model, batch, decoding_strategy="s2d2", block_size=16,
                                do_verify_policy="score_threshold")


@pytest.mark.parametrize("strategy,kwargs", [
    ("block_diffusion", {"confidence_threshold": 0.5}),
    ("s2d2", {"min_ssd_span_length": 2, "cache_ver": True}),
])
def test_batch_cache_equals_no_cache_and_fused_equals_unfused(sdar_model, batch, strategy, kwargs):
    ids, mask, _ = batch
    runs = [sdar_model.generate(ids, attention_mask=mask, decoding_strategy=strategy, block_size=4, **COMMON,
                                **kwargs, **extra)
            for extra in ({}, {"use_cache": False}, {"fuse_cache_write": False})]
    assert torch.equal(runs[0].sequences, runs[1].sequences) and torch.equal(runs[0].sequences, runs[2].sequences)
    fused, unfused = runs[0].spec_stats, runs[2].spec_stats
    assert fused.num_cache_write_forwards == 0 and unfused.num_cache_write_forwards > 0


def test_rows_stop_at_their_own_stop_id(sdar_model, batch):
    """A stop id ends each row where it appears; the finished rows are padded and leave the batch."""
    ids, mask, prompts = batch
    free = sdar_model.generate(ids, attention_mask=mask, decoding_strategy="block_diffusion", **COMMON)
    stop = int(free.sequences[2, ids.shape[1] + 5])          # a token row 2 emits mid-way
    kwargs = {**COMMON, "eos_token_id": stop, "pad_token_id": 0}
    out = sdar_model.generate(ids, attention_mask=mask, decoding_strategy="block_diffusion", **kwargs)
    for i, p in enumerate(prompts):
        single = sdar_model.generate(p[None], decoding_strategy="block_diffusion", **kwargs).sequences[0, len(p):]
        row = out.sequences[i, ids.shape[1]:]
        assert row[: len(single)].tolist() == single.tolist()
        assert (row[len(single):] == 0).all()
    assert out.sequences.shape[1] - ids.shape[1] <= COMMON["max_new_tokens"]


def test_sampling_same_seed_same_batch(sdar_model, batch):
    ids, mask, _ = batch
    kwargs = dict(COMMON, do_sample=True, top_k=0, decoding_strategy="s2d2", block_size=4, min_ssd_span_length=2)
    a = sdar_model.generate(ids, attention_mask=mask, generator=gen(11), **kwargs)
    b = sdar_model.generate(ids, attention_mask=mask, generator=gen(11), **kwargs)
    c = sdar_model.generate(ids, attention_mask=mask, generator=gen(12), **kwargs)
    assert torch.equal(a.sequences, b.sequences)
    assert not torch.equal(a.sequences, c.sequences)
    assert a.spec_stats.num_verify_forwards > 0 and a.spec_stats.num_recovered_tokens >= 0
    no_cache = sdar_model.generate(ids, attention_mask=mask, generator=gen(11), use_cache=False, **kwargs)
    assert torch.equal(a.sequences, no_cache.sequences)


def test_padding_invariance_of_a_single_prompt(sdar_model, batch):
    """The same prompt left-padded by different amounts decodes to the same tokens (NVlabs/Fast-dLLM #39)."""
    _, _, prompts = batch
    p = prompts[4]
    outs = []
    for pad in (0, 3, 9):
        ids = torch.cat([torch.zeros(pad, dtype=torch.long), p])[None]
        mask = (torch.arange(ids.shape[1]) >= pad).long()[None]
        out = sdar_model.generate(ids, attention_mask=mask, decoding_strategy="s2d2", block_size=4, **COMMON)
        outs.append(out.sequences[0, pad + len(p):].tolist())
    assert outs[0] == outs[1] == outs[2]


def test_rows_leave_before_the_cache_holds_anything(sdar_model):
    """The mechanism of the batch crash: a read-only forward sizes every cache layer for N rows and the crop leaves
    it without columns; rows then leave (transformers' `batch_select_indices` skips a layer of length 0) and the next
    storing forward of the remaining rows must append to a layer of M rows, not N."""
    from hf_dllm_spec.maths.masks import causal_mask, full_mask
    from hf_dllm_spec.outputs import BatchStats
    from hf_dllm_spec.runtime.runner import ModelRunner
    from model_patches import get_patch

    runner = ModelRunner(sdar_model, get_patch(sdar_model), BatchStats(3), batch_size=3)
    ids = torch.tensor([[5, 6, 7], [8, 9, 10], [11, 12, 13]])
    pos = torch.arange(3).expand(3, 3)
    runner.forward(ids, pos, full_mask(3), kind="draft")                     # read-only: nothing stored
    assert runner.stored_len == 0 and runner.cache.layers[0].keys.shape[0] == 3
    runner.select_rows(torch.tensor([2, 0]))
    assert all(layer.keys.shape[0] == 2 for layer in runner.cache.layers)
    logits = runner.forward(ids[[2, 0]], pos[:2], causal_mask(3), kind="prefill", store_len=3)
    fresh = ModelRunner(sdar_model, get_patch(sdar_model), BatchStats(2), batch_size=2)
    assert torch.allclose(logits, fresh.forward(ids[[2, 0]], pos[:2], causal_mask(3), kind="prefill", store_len=3))


BUNDLED = pathlib.Path(__file__).resolve().parents[1] / "models"
#: The issue's batch (issue 23): the second row ends at once on the bundled models.
SHORT_PROMPTS = ["Question: Tom has", "14 + 3 = 17. The answer is 17."]


@pytest.mark.parametrize("model_name,drafter_name,kwargs,prompts", [
    ("llada2-tiny", None, {"decoding_strategy": "llada2"}, SHORT_PROMPTS),
    ("llada2-tiny", None, {"decoding_strategy": "s2d2", "preset": "llada2.1-mini-quality"}, SHORT_PROMPTS),
    ("sdar-tiny-arith", None, {"decoding_strategy": "block_diffusion", "block_size": 32}, SHORT_PROMPTS),
    ("sdar-tiny-arith", None, {"decoding_strategy": "s2d2", "block_size": 32}, SHORT_PROMPTS),
    ("sdar-large", "sdar-tiny-arith", {"decoding_strategy": "simsd", "block_size": 32, "draft_block_size": 32},
     SHORT_PROMPTS),
    ("fast-dllm-v2-tiny", None, {"decoding_strategy": "fast_dllm_v2", "fuse_cache_write": True}, SHORT_PROMPTS),
    ("sdar-tiny-arith", None, {"decoding_strategy": "s2d2", "block_size": 2}, ["Question", "7", "The", "def"]),
    ("qwen2-tiny-ar", "deer-drafter-tiny", {"decoding_strategy": "deer", "draft_attention": "full", "block_size": 4},
     None),
])
def test_reported_batches_that_crashed_equal_one_by_one(model_name, drafter_name, kwargs, prompts, one_thread):
    """Each batch of the report crashed in transformers' cache update; each row now decodes as it does alone."""
    import warnings

    import hf_dllm_spec
    from hf_dllm_spec.tools.jobs.evaluation import arithmetic_prompts, load

    tokenizer, model = load(BUNDLED / model_name)
    if drafter_name is not None:
        kwargs = {**kwargs, "draft_model": load(BUNDLED / drafter_name)[1]}
    if not isinstance(model, hf_dllm_spec.DllmGenerationMixin):
        kwargs = {**kwargs, "custom_generate": hf_dllm_spec.custom_generate}
    prompts = prompts or [p.text for p in arithmetic_prompts(BUNDLED / "sdar-tiny-arith", 8)]
    tokenizer.padding_side = "left"
    common = dict(max_new_tokens=32, do_sample=False, pad_token_id=tokenizer.pad_token_id, **kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")                      # block size 32 on a model trained at 4 warns
        enc = tokenizer(prompts, return_tensors="pt", padding=True)
        out = model.generate(enc.input_ids, attention_mask=enc.attention_mask, **common)
        for i, text in enumerate(prompts):
            ids = tokenizer(text, return_tensors="pt").input_ids
            alone = model.generate(ids, **common)[0, ids.shape[1]:].tolist()
            row = out[i, enc.input_ids.shape[1]:]
            assert row[:len(alone)].tolist() == alone, f"row {i}: {text!r}"
            assert (row[len(alone):] == tokenizer.pad_token_id).all()


@pytest.mark.parametrize("runtime", [{}, {"cache_implementation": "static"}], ids=["eager", "static"])
def test_deer_rows_near_their_budget_keep_their_counters(one_thread, runtime):
    """A DEER row one token short of its budget drafts nothing and takes one AR step: the cycle's drafter forward,
    run for the other rows, is not charged to it (its `nfe` and drafter forwards were one more than alone)."""
    import hf_dllm_spec
    from hf_dllm_spec.tools.jobs.evaluation import load

    tokenizer, target = load(BUNDLED / "qwen2-tiny-ar")
    drafter = load(BUNDLED / "deer-drafter-tiny")[1]
    prompts = [tokenizer("Question: 3 + 4?\nAnswer:").input_ids, [349]]     # rows that end different cycles
    pad = tokenizer.pad_token_id
    width = max(map(len, prompts))
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    common = dict(custom_generate=hf_dllm_spec.custom_generate, decoding_strategy="deer", draft_model=drafter,
                  block_size=4, eos_token_id=None, pad_token_id=pad, return_dict_in_generate=True, **runtime)
    for budget in (5, 7, 9):
        out = target.generate(ids, attention_mask=(ids != pad).long(), max_new_tokens=budget, **common)
        for i, prompt in enumerate(prompts):
            alone = target.generate(torch.tensor([prompt]), max_new_tokens=budget, **common)
            got, want = out.spec_stats_per_row[i], alone.spec_stats
            assert {k: v for k, v in counters(got).items() if not k.endswith("_time_s")} == \
                {k: v for k, v in counters(want).items() if not k.endswith("_time_s")}, (budget, i)
            assert (got.nfe, got.num_forward_calls) == (want.nfe, want.num_forward_calls), (budget, i)


def test_rows_that_stop_early_are_padded_with_the_first_stop_id(sdar_model, batch):
    """Without `pad_token_id`, a batch pads rows that end early with the first of the stop ids, as transformers
    pads with `eos_token_id[0]`."""
    ids, mask, _ = batch
    free = sdar_model.generate(ids, attention_mask=mask, decoding_strategy="block_diffusion", max_new_tokens=14,
                               eos_token_id=None, pad_token_id=0)
    width = ids.shape[1]
    early = free[0, width + 2].item()                                   # row 0 stops at its third token
    late = next(t for t in range(90) if t not in free[:, width:].tolist()[0] and t != early)   # never generated
    out = sdar_model.generate(ids, attention_mask=mask, decoding_strategy="block_diffusion", max_new_tokens=14,
                              eos_token_id=[early, late], pad_token_id=None)
    row = out[0, width:].tolist()
    cut = row.index(early) + 1
    assert cut <= 3 and row[cut:] == [early] * (len(row) - cut) and len(row) > cut
