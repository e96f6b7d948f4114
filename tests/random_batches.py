"""Random left-padded batches for the property tests (tests/test_batch_properties.py, tests/test_static_properties.py):
every strategy on every family, on tiny random models.

A case is `(prompts, params, budget, stop)`: 1-4 prompts of 1-10 tokens, the strategy's parameters (block sizes from
1 token up to twice the trained size), a budget from 1 token, and which row's own output at which step gives the
stop id (or None), so that rows end anywhere. SimSD drafts with an SDAR drafter for an SDAR target; DEER with an
SDAR drafter for an AR Qwen3 target, both drafter attentions.

Exact token equality in float32 assumes no step has a tie: two best logits within a float32 ulp can round either
way in differently shaped computations (a padding column, a batched matmul), and greedy then takes the other token.
:func:`check_or_tie` re-checks a float32 failure in float64, where such a tie disappears and a decoding bug stays.
"""

from __future__ import annotations

import copy
import warnings
from typing import Callable

import torch
from conftest import MASK_ID, tiny_family_models
from hypothesis import assume
from hypothesis import strategies as st

import hf_dllm_spec
from hf_dllm_spec.integration.plan import check_block_budget
from model_patches import get_patch

PAD = 0

MODELS = tiny_family_models()

#: name -> (target, drafter, parameter draws: name -> hypothesis strategy).
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
    """A random case for `name`: prompts, parameters, budget and which row's output gives the stop id."""
    params = {key: draw(value) for key, value in CASES[name][2].items()}
    if "sub_block_size" in params and params["sub_block_size"] > params["block_size"]:
        params["sub_block_size"] = params["block_size"]
    if name == "simsd":
        params["draft_block_size"] = params["block_size"]
    if "min_ssd_span_length" in params:                      # a span no longer than a block (longer is refused)
        params["min_ssd_span_length"] = min(params["min_ssd_span_length"], params["block_size"])
    lengths = draw(st.lists(st.integers(1, 10), min_size=1, max_size=4))
    prompts = [draw(st.lists(st.integers(2, MASK_ID - 1), min_size=n, max_size=n)) for n in lengths]
    budget = draw(st.integers(1, 12))
    stop = draw(st.one_of(st.none(), st.tuples(st.integers(0, len(prompts) - 1), st.integers(0, budget - 1))))
    return prompts, params, budget, stop


def left_padded(prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """`(ids, attention_mask)`, both `(N, P)`: the prompts left-padded with `PAD` to the longest."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[PAD] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    return ids, mask


def generate(name: str, ids: torch.Tensor, mask: torch.Tensor | None, params: dict, budget: int, eos,
             models: dict = MODELS, **options):
    """`model.generate` of the case `name` (its target, drafter and strategy) with `options` added."""
    target_name, drafter_name, _ = CASES[name]
    target = models[target_name]
    extra = {"draft_model": models[drafter_name]} if drafter_name else {}
    if target_name == "qwen":
        extra["custom_generate"] = hf_dllm_spec.custom_generate
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")       # block sizes off the trained one warn; they are drawn on purpose
        return target.generate(ids, attention_mask=mask, decoding_strategy=STRATEGY.get(name, name),
                               max_new_tokens=budget, eos_token_id=eos, pad_token_id=PAD, **params, **extra,
                               **options)


def assume_it_fits(name: str, prompts: list[list[int]], params: dict, budget: int) -> None:
    """Skip (hypothesis `assume`) a case whose block is larger than the whole sequence: refused by design."""
    if "block_size" in params and name != "deer":
        target = MODELS[CASES[name][0]]
        try:
            check_block_budget(params["block_size"], get_patch(target).trained_block_size(target),
                               [len(p) for p in prompts], budget)
        except ValueError:
            assume(False)


def stop_id(name: str, case, models: dict = MODELS, **options) -> int | None:
    """The case's stop id: the token its chosen row produces alone (with `options`) at the chosen step, or None."""
    prompts, params, budget, stop = case
    if stop is None:
        return None
    row, step = stop
    free = generate(name, torch.tensor([prompts[row]]), None, params, budget, None, models, **options)
    free = free if isinstance(free, torch.Tensor) else free.sequences
    new = free[0, len(prompts[row]):]
    return int(new[min(step, new.shape[0] - 1)])


_FLOAT64: dict = {}
#: Case names whose one float32 mismatch was forgiven as a tie in this process (none of 905 cases on 2026-11-29,
#: torch 2.13).
_TIES: set = set()


def check_or_tie(check: Callable[[str, tuple, dict], None], name: str, case) -> None:
    """`check(name, case, models)` in float32; a mismatch is re-checked in float64, where a float32 tie (see the module
    docstring) disappears and a decoding bug stays. A family that cannot run in float64 keeps its float32 failure, and
    so does a second mismatch of the same case name in one process: ties are rare (none in the suite's 905 cases when
    this was written), while a bug of float32 alone (a dtype, a mask's fill value) would pass every float64 check."""
    try:
        check(name, case, MODELS)
    except AssertionError as float32_failure:
        if name in _TIES:
            raise AssertionError(f"a second float32 mismatch of {name!r} in this process: not a tie") \
                from float32_failure
        if not _FLOAT64:
            _FLOAT64.update({key: copy.deepcopy(model).double() for key, model in MODELS.items()})
        try:
            check(name, case, _FLOAT64)
        except AssertionError:
            raise
        except Exception:
            raise float32_failure from None
        _TIES.add(name)
        warnings.warn(f"{name}: a float32 mismatch that float64 resolves, taken as a tie: {case!r}")
