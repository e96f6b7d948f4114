"""The bad-input catalogue: every case fails before any forward, with the library's error format.

Each case is a call of `generate` on the tiny SDAR model (or a variant of it). The test asserts the exception
type, that the message names the argument in backticks (the format of `hf_dllm_spec.validation.invalid`:
argument, value, rule, fix) and that the model ran no forward.
"""

from __future__ import annotations

import math

import pytest
import torch
from conftest import MASK_ID, TINY
from transformers import LogitsProcessorList, StoppingCriteriaList, TemperatureLogitsWarper
from transformers.generation.streamers import BaseStreamer

import hf_dllm_spec
from hf_dllm_spec import ARConfig, BlockDiffusionConfig, S2D2Config
from model_patches.sdar import SDARConfig, SDARForCausalLM

PROMPT = [[5, 17, 42, 8, 23, 61, 4]]
NAN, INF = math.nan, math.inf


class ReadsContext(TemperatureLogitsWarper):
    """A user subclass of an allowed processor that reads `input_ids` (it would get dummy ids)."""

    def __call__(self, input_ids, scores):
        return scores - 0.1 * (input_ids[:, -1:] > 10).float()


class _NullStreamer(BaseStreamer):
    def put(self, value):
        pass

    def end(self):
        pass


class _OtherDeviceGenerator:
    """Not a `torch.Generator`."""


class _CudaGenerator(torch.Generator):
    """A `torch.Generator` that reports a CUDA device (none can be built on a CPU-only machine)."""

    @property
    def device(self):
        return torch.device("cuda")


#: (case id, generate keyword arguments, argument the message must name, exception type)
CASES: list[tuple[str, dict, str, type]] = [
    # NaN and infinity in float parameters
    ("threshold-nan", dict(decoding_strategy="block_diffusion", confidence_threshold=NAN), "confidence_threshold",
     ValueError),
    ("threshold-inf", dict(decoding_strategy="block_diffusion", confidence_threshold=INF), "confidence_threshold",
     ValueError),
    ("eb-nan", dict(decoding_strategy="block_diffusion", eb_threshold=NAN), "eb_threshold", ValueError),
    ("eb-inf", dict(decoding_strategy="block_diffusion", eb_threshold=INF), "eb_threshold", ValueError),
    ("tempering-nan", dict(decoding_strategy="s2d2", ssd_ratio_tempering_factor=NAN), "ssd_ratio_tempering_factor",
     ValueError),
    ("tempering-inf", dict(decoding_strategy="s2d2", ssd_ratio_tempering_factor=INF), "ssd_ratio_tempering_factor",
     ValueError),
    ("hysteresis-on-nan", dict(decoding_strategy="s2d2", do_verify_policy="score_hysteresis",
                               hysteresis_threshold_on=NAN), "hysteresis_threshold_on", ValueError),
    ("hysteresis-off-inf", dict(decoding_strategy="s2d2", hysteresis_threshold_off=-INF), "hysteresis_threshold_off",
     ValueError),
    ("score-threshold-inf", dict(decoding_strategy="s2d2", do_verify_score_threshold=INF),
     "do_verify_score_threshold", ValueError),
    ("score-threshold-nan", dict(decoding_strategy="s2d2", do_verify_score_threshold=NAN),
     "do_verify_score_threshold", ValueError),
    ("penalty-nan", dict(decoding_strategy="s2d2", score_penalty_coef=NAN), "score_penalty_coef", ValueError),
    ("margin-nan", dict(decoding_strategy="s2d2", ssd_confidence_margin_threshold=NAN),
     "ssd_confidence_margin_threshold", ValueError),
    ("entropy-temp-inf", dict(decoding_strategy="s2d2", ssd_entropy_temperature=INF), "ssd_entropy_temperature",
     ValueError),
    ("entropy-threshold-nan", dict(decoding_strategy="s2d2", ssd_entropy_threshold=NAN), "ssd_entropy_threshold",
     ValueError),
    ("power-nan", dict(decoding_strategy="s2d2", ssd_confidence_power=NAN), "ssd_confidence_power", ValueError),
    ("margin-coef-inf", dict(decoding_strategy="s2d2", ssd_confidence_margin_coef=INF),
     "ssd_confidence_margin_coef", ValueError),
    ("ucb-beta-nan", dict(decoding_strategy="s2d2", ucb_beta=NAN), "ucb_beta", ValueError),
    ("top-p-nan", dict(decoding_strategy="s2d2", do_sample=True, top_p=NAN), "top_p", ValueError),
    ("min-p-inf", dict(decoding_strategy="s2d2", do_sample=True, min_p=INF), "min_p", ValueError),
    ("temperature-nan", dict(decoding_strategy="s2d2", do_sample=True, temperature=NAN), "temperature", ValueError),
    ("typical-nan", dict(decoding_strategy="s2d2", do_sample=True, typical_p=NAN), "typical_p", ValueError),
    # sizes and budgets
    ("block-size-beyond-positions", dict(decoding_strategy="block_diffusion", block_size=512), "block_size",
     ValueError),
    ("block-size-zero", dict(decoding_strategy="block_diffusion", block_size=0), "block_size", ValueError),
    ("block-size-float", dict(decoding_strategy="block_diffusion", block_size=2.5), "block_size", ValueError),
    ("block-size-bool", dict(decoding_strategy="block_diffusion", block_size=True), "block_size", ValueError),
    ("steps-beyond-implicit-block", dict(decoding_strategy="block_diffusion", steps_per_block=8), "steps_per_block",
     ValueError),
    ("steps-beyond-explicit-block", dict(decoding_strategy="block_diffusion", block_size=4, steps_per_block=8),
     "steps_per_block", ValueError),
    ("max-new-tokens-float", dict(decoding_strategy="s2d2", max_new_tokens=2.5), "max_new_tokens", ValueError),
    ("max-new-tokens-str", dict(decoding_strategy="s2d2", max_new_tokens="8"), "max_new_tokens", ValueError),
    ("max-new-tokens-zero", dict(decoding_strategy="s2d2", max_new_tokens=0), "max_new_tokens", ValueError),
    ("max-length-below-prompt", dict(decoding_strategy="s2d2", max_new_tokens=None, max_length=3), "max_length",
     ValueError),
    ("remasking-unknown", dict(decoding_strategy="block_diffusion", remasking_strategy="random"),
     "remasking_strategy", ValueError),
    ("policy-unknown", dict(decoding_strategy="s2d2", do_verify_policy="always"), "do_verify_policy", ValueError),
    ("preset-unknown", dict(decoding_strategy="s2d2", preset="sdar-9b"), "preset", ValueError),
    ("strategy-unknown", dict(decoding_strategy="speculative"), "decoding_strategy", ValueError),
    # input_ids
    ("ids-1d", dict(decoding_strategy="s2d2", input_ids=torch.tensor(PROMPT[0])), "input_ids", ValueError),
    ("ids-list", dict(decoding_strategy="s2d2", input_ids=PROMPT), "input_ids", ValueError),
    ("ids-float", dict(decoding_strategy="s2d2", input_ids=torch.tensor(PROMPT, dtype=torch.float32)), "input_ids",
     ValueError),
    ("ids-beyond-vocab", dict(decoding_strategy="s2d2", input_ids=torch.tensor([[5, 17, 120]])), "input_ids",
     ValueError),
    ("ids-negative", dict(decoding_strategy="s2d2", input_ids=torch.tensor([[5, -3, 17]])), "input_ids", ValueError),
    ("ids-3d", dict(decoding_strategy="s2d2", input_ids=torch.tensor([PROMPT])), "input_ids", ValueError),
    ("ids-empty", dict(decoding_strategy="s2d2", input_ids=torch.zeros(1, 0, dtype=torch.long)), "input_ids",
     ValueError),
    ("mask-in-prompt", dict(decoding_strategy="s2d2", input_ids=torch.tensor([[5, 17, MASK_ID, 8]])), "input_ids",
     ValueError),
    # special tokens
    ("mask-beyond-vocab", dict(decoding_strategy="s2d2", mask_token_id=99), "mask_token_id", ValueError),
    ("mask-negative", dict(decoding_strategy="s2d2", mask_token_id=-1), "mask_token_id", ValueError),
    ("mask-is-stop-id", dict(decoding_strategy="s2d2", mask_token_id=7, eos_token_id=7), "mask_token_id",
     ValueError),
    ("eos-beyond-vocab", dict(decoding_strategy="s2d2", eos_token_id=1000), "eos_token_id", ValueError),
    ("pad-beyond-vocab", dict(decoding_strategy="s2d2", pad_token_id=1000), "pad_token_id", ValueError),
    # generation options transformers knows but the strategies do not support
    ("num-beams", dict(decoding_strategy="s2d2", num_beams=2), "num_beams", ValueError),
    ("num-return-sequences", dict(decoding_strategy="s2d2", num_return_sequences=2), "num_return_sequences",
     ValueError),
    ("output-scores", dict(decoding_strategy="s2d2", output_scores=True, return_dict_in_generate=True),
     "output_scores", ValueError),
    ("cache-static", dict(decoding_strategy="s2d2", cache_implementation="static"), "cache_implementation",
     ValueError),
    ("repetition-penalty", dict(decoding_strategy="s2d2", repetition_penalty=1.3), "repetition_penalty",
     NotImplementedError),
    ("min-new-tokens", dict(decoding_strategy="s2d2", min_new_tokens=4, eos_token_id=7), "min_length",
     NotImplementedError),
    ("no-repeat-ngram", dict(decoding_strategy="s2d2", no_repeat_ngram_size=2), "no_repeat_ngram_size",
     NotImplementedError),
    ("sequence-bias-multi-token", dict(decoding_strategy="s2d2", sequence_bias={(5, 6): 2.0}), "sequence_bias",
     NotImplementedError),
    ("processor-subclass", dict(decoding_strategy="s2d2", do_sample=True,
                                logits_processor=LogitsProcessorList([ReadsContext(0.7)])), "logits_processor",
     NotImplementedError),
    # randomness
    ("generator-int", dict(decoding_strategy="s2d2", generator=0), "generator", ValueError),
    ("generator-other-type", dict(decoding_strategy="s2d2", generator=_OtherDeviceGenerator()), "generator",
     ValueError),
    # strategy_config
    ("config-ar-for-bd", dict(decoding_strategy="block_diffusion", strategy_config=ARConfig()), "strategy_config",
     ValueError),
    ("config-s2d2-for-bd", dict(decoding_strategy="block_diffusion", strategy_config=S2D2Config()),
     "strategy_config", ValueError),
    ("config-bd-for-s2d2", dict(decoding_strategy="s2d2", strategy_config=BlockDiffusionConfig()), "strategy_config",
     ValueError),
    ("config-dict", dict(decoding_strategy="s2d2", strategy_config={"block_size": 4}), "strategy_config", ValueError),
    # masks and positions
    ("attention-mask-shape", dict(decoding_strategy="s2d2", attention_mask=torch.ones(1, 5, dtype=torch.long)),
     "attention_mask", ValueError),
    ("attention-mask-right-padding", dict(decoding_strategy="s2d2",
                                          attention_mask=torch.tensor([[1, 1, 1, 1, 1, 1, 0]])), "attention_mask",
     ValueError),
    ("position-ids", dict(decoding_strategy="s2d2", position_ids=torch.arange(7)[None] + 3), "position_ids",
     ValueError),
    # drafters
    ("assistant-for-self-speculation", dict(decoding_strategy="s2d2", assistant_model="<model>"), "assistant_model",
     ValueError),
    ("draft-for-self-speculation", dict(decoding_strategy="s2d2", draft_model="<model>"), "draft_model", ValueError),
    # batches
    ("streamer-batch", dict(decoding_strategy="s2d2", input_ids=torch.tensor(PROMPT * 2), pad_token_id=0,
                            streamer=_NullStreamer()), "streamer", ValueError),
    ("generator-other-device", dict(decoding_strategy="s2d2", generator=_CudaGenerator()), "generator", ValueError),
]


@pytest.fixture(scope="module")
def counted(sdar_model):
    """The tiny SDAR model with a forward counter."""
    calls = []
    handle = sdar_model.register_forward_pre_hook(lambda module, args: calls.append(1))
    yield sdar_model, calls
    handle.remove()


def _run(model, kwargs):
    kwargs = dict(kwargs)
    ids = kwargs.pop("input_ids", torch.tensor(PROMPT))
    for key in ("assistant_model", "draft_model"):
        if kwargs.get(key) == "<model>":
            kwargs[key] = model
    kwargs.setdefault("max_new_tokens", 8)
    if kwargs["max_new_tokens"] is None:
        kwargs.pop("max_new_tokens")
    return model.generate(ids, **kwargs)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_caught_before_any_forward(counted, case):
    _, kwargs, name, error = case
    model, calls = counted
    calls.clear()
    with pytest.raises(error) as info:
        _run(model, kwargs)
    assert f"`{name}`" in str(info.value), str(info.value)
    assert not calls, f"{len(calls)} forward(s) ran before the error"


def test_catalogue_size():
    assert len(CASES) + len(MODEL_CASES) >= 50


def _meta_model():
    with torch.device("meta"):
        return SDARForCausalLM(SDARConfig(block_size=4, mask_token_id=MASK_ID, **TINY)).eval()


MODEL_CASES = [
    ("model-on-meta", _meta_model, dict(decoding_strategy="s2d2"), "model"),
]


@pytest.mark.parametrize("case", MODEL_CASES, ids=[c[0] for c in MODEL_CASES])
def test_bad_model_is_caught(case):
    _, build, kwargs, name = case
    with pytest.raises(ValueError) as info:
        _run(build(), kwargs)
    assert f"`{name}`" in str(info.value), str(info.value)


def test_custom_generate_path_checks_the_same(counted):
    """The plain transformers entry point (`custom_generate=`) runs the same checks."""
    model, calls = counted
    calls.clear()
    with pytest.raises(ValueError, match="`confidence_threshold`"):
        super(SDARForCausalLM, model).generate(torch.tensor(PROMPT), custom_generate=hf_dllm_spec.custom_generate,
                                               decoding_strategy="s2d2", confidence_threshold=NAN, max_new_tokens=8)
    assert not calls


def test_exact_allowed_processor_still_runs(sdar_model):
    """The allow-list is by exact class: the stock warper is accepted."""
    out = sdar_model.generate(torch.tensor(PROMPT), decoding_strategy="s2d2", max_new_tokens=4, do_sample=True,
                              logits_processor=LogitsProcessorList([TemperatureLogitsWarper(0.7)]),
                              generator=torch.Generator().manual_seed(0))
    assert out.shape[1] <= len(PROMPT[0]) + 4


def test_consistent_position_ids_are_accepted(sdar_model):
    ids = torch.tensor(PROMPT)
    a = sdar_model.generate(ids, decoding_strategy="s2d2", max_new_tokens=6)
    b = sdar_model.generate(ids, decoding_strategy="s2d2", max_new_tokens=6, position_ids=torch.arange(7)[None])
    assert torch.equal(a, b)


def test_stopping_criteria_list_is_accepted(sdar_model):
    out = sdar_model.generate(torch.tensor(PROMPT), decoding_strategy="s2d2", max_new_tokens=6,
                              stopping_criteria=StoppingCriteriaList())
    assert out.shape[1] <= len(PROMPT[0]) + 6
