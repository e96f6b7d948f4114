"""Property: a random left-padded batch decodes every row exactly as that prompt decodes alone (greedy, fp32).

Random batches of 1-4 prompts of 1-10 tokens, random block sizes and budgets, and a stop id taken from a row's own
output at a random step, so that rows end anywhere, also before their first block reaches the KV cache (the case
that crashed transformers' cache update: a row left while the cache was still empty). Every strategy on every
family: the SDAR, Fast-dLLM v2 and LLaDA2 tiny models, SimSD (SDAR drafter and target) and DEER (SDAR drafter, AR
Qwen3 target, both drafter attentions). 20 batches per strategy in the fast suite, 100 in the full suite.

Exact token equality in float32 assumes no step has a tie: two best logits within a float32 ulp can round either
way in differently shaped computations (a padding column, a batched matmul), and greedy then takes the other token.
A failure that float64 does not reproduce is such a tie, not a decoding bug (`TIE_CASE` below, once recorded as a
block size 1 bug).
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from conftest import MASK_ID, tiny_family_models
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import hf_dllm_spec
from hf_dllm_spec.integration.plan import check_block_budget
from hf_dllm_spec.maths.sampling import Sampler
from model_patches import get_patch

PAD = 0


MODELS = tiny_family_models()

#: name -> (target, drafter, parameter draws: name -> hypothesis strategy). Block sizes from 1 token up to twice
#: the trained size; the budget from 1 token.
BLOCKS = st.sampled_from([1, 2, 4, 8])
CASES = {
    "ar": ("sdar", None, {}),
    "block_diffusion": ("sdar", None, {"block_size": BLOCKS, "confidence_threshold": st.sampled_from([0.5, 0.9]),
                                       "fuse_cache_write": st.booleans()}),
    "block_diffusion_static": ("sdar", None, {"block_size": BLOCKS, "fuse_cache_write": st.booleans(),
                                              "remasking_strategy": st.just("low_confidence_static")}),
    "s2d2": ("sdar", None, {"block_size": BLOCKS, "min_ssd_span_length": st.sampled_from([1, 2]),
                            "cache_ver": st.booleans(), "draft_ver": st.booleans()}),
    "fast_dllm_v2": ("fast", None, {"block_size": st.sampled_from([4, 8]), "sub_block_size": st.sampled_from([2, 4]),
                                    "fuse_cache_write": st.booleans()}),
    "s2d2_fast_dllm_v2": ("fast", None, {"block_size": st.sampled_from([4, 8]), "sub_block_size": st.just(4)}),
    "llada2": ("llada2", None, {"block_size": st.sampled_from([2, 4, 8])}),
    "s2d2_llada2": ("llada2", None, {"block_size": st.sampled_from([2, 4, 8]),
                                     "preset": st.just("llada2.1-mini-quality")}),
    "simsd": ("sdar", "sdar_drafter", {"block_size": st.sampled_from([2, 4])}),
    "deer": ("qwen", "sdar_drafter", {"block_size": st.sampled_from([1, 2, 4, 8]),
                                      "draft_attention": st.sampled_from(["causal_prefix", "full"])}),
}
STRATEGY = {"block_diffusion_static": "block_diffusion", "s2d2_fast_dllm_v2": "s2d2", "s2d2_llada2": "s2d2"}


@st.composite
def batches(draw, name: str):
    """A random batch for the case `name`: prompts, parameters, budget and which row's output gives the stop id."""
    params = {key: draw(value) for key, value in CASES[name][2].items()}
    if "sub_block_size" in params and params["sub_block_size"] > params["block_size"]:
        params["sub_block_size"] = params["block_size"]
    if name == "simsd":
        params["draft_block_size"] = params["block_size"]
    lengths = draw(st.lists(st.integers(1, 10), min_size=1, max_size=4))
    prompts = [draw(st.lists(st.integers(2, MASK_ID - 1), min_size=n, max_size=n)) for n in lengths]
    budget = draw(st.integers(1, 12))
    stop = draw(st.one_of(st.none(), st.tuples(st.integers(0, len(prompts) - 1), st.integers(0, budget - 1))))
    return prompts, params, budget, stop


def _generate(name: str, ids: torch.Tensor, mask: torch.Tensor | None, params: dict, budget: int, eos,
              models: dict = MODELS) -> torch.Tensor:
    target_name, drafter_name, _ = CASES[name]
    target = models[target_name]
    extra = {"draft_model": models[drafter_name]} if drafter_name else {}
    if target_name == "qwen":
        extra["custom_generate"] = hf_dllm_spec.custom_generate
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")       # block sizes off the trained one warn; they are drawn on purpose
        return target.generate(ids, attention_mask=mask, decoding_strategy=STRATEGY.get(name, name),
                               max_new_tokens=budget, eos_token_id=eos, pad_token_id=PAD, **params, **extra)


def _check(name: str, case, models: dict = MODELS) -> None:
    prompts, params, budget, stop = case
    if "block_size" in params and name != "deer":      # a block larger than the whole sequence is refused
        target = MODELS[CASES[name][0]]
        try:
            check_block_budget(params["block_size"], get_patch(target).trained_block_size(target),
                               [len(p) for p in prompts], budget)
        except ValueError:
            assume(False)
    eos = None
    if stop is not None:                      # a token the row really produces at that step: rows end anywhere
        row, step = stop
        free = _generate(name, torch.tensor([prompts[row]]), None, params, budget, None, models)[0, len(prompts[row]):]
        eos = int(free[min(step, free.shape[0] - 1)])
    singles = [_generate(name, torch.tensor([p]), None, params, budget, eos, models)[0, len(p):] for p in prompts]
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[PAD] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    out = _generate(name, ids, mask, params, budget, eos, models)
    for i, single in enumerate(singles):
        row = out[i, width:]
        assert row[: single.shape[0]].tolist() == single.tolist(), f"row {i} of {prompts}"
        assert (row[single.shape[0]:] == PAD).all()


_FLOAT64: dict = {}


def _check_or_tie(name: str, case) -> None:
    """`_check` in float32; a mismatch is re-checked in float64, where a float32 tie (see the module docstring)
    disappears and a decoding bug stays. A family that cannot run in float64 keeps its float32 failure."""
    try:
        _check(name, case)
    except AssertionError as float32_failure:
        if not _FLOAT64:
            _FLOAT64.update({key: copy.deepcopy(model).double() for key, model in MODELS.items()})
        try:
            _check(name, case, _FLOAT64)
        except AssertionError:
            raise
        except Exception:
            raise float32_failure from None


def _property(name: str, examples: int):
    @settings(max_examples=examples, deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much])
    @given(case=batches(name))
    def run(case):
        _check_or_tie(name, case)

    return run


@pytest.mark.parametrize("name", list(CASES))
def test_batch_equals_one_by_one(name, one_thread):
    _property(name, 20)()


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_batch_equals_one_by_one_many(name, one_thread):
    _property(name, 100)()


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
    _generate("block_diffusion_static", torch.tensor([prompts[1]]), None, params, 1, None)
    single = seen[0][0, 0]
    seen.clear()
    ids, mask = torch.tensor([[2, 2, 2], [PAD, 79, 65]]), torch.tensor([[1, 1, 1], [0, 1, 1]])
    _generate("block_diffusion_static", ids, mask, params, 1, None)
    batched = seen[0][1, 0]
    torch.testing.assert_close(batched, single, rtol=0, atol=1e-5)          # the cache and padding are exact
    top = single.topk(2)
    assert sorted(top.indices.tolist()) == [7, 52] and float(top.values[0] - top.values[1]) < 1e-6    # the tie
