"""The bad-input catalogue: every case fails before any forward, with the library's error format.

Each case is a call of `generate` on the tiny SDAR model (or a variant of it). The test asserts the exception
type, that the message names the argument in backticks (the format of `hf_dllm_spec.validation.invalid`:
argument, value, rule, fix) and that the model ran no forward.
"""

from __future__ import annotations

import math

import pytest
import torch
from conftest import MASK_ID, TINY, tiny_family_models
from transformers import (GenerationConfig, LogitsProcessorList, Qwen2Config, Qwen2ForCausalLM, StoppingCriteriaList,
                          TemperatureLogitsWarper)
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
def _stored(value) -> GenerationConfig:
    config = GenerationConfig(max_new_tokens=8)
    config.dllm_decoding = value
    return config


CASES: list[tuple[str, dict, str, type]] = [
    # NaN and infinity in float parameters
    ("threshold-nan", dict(decoding_strategy="block_diffusion", confidence_threshold=NAN), "confidence_threshold",
     ValueError),
    ("threshold-inf", dict(decoding_strategy="block_diffusion", confidence_threshold=INF), "confidence_threshold",
     ValueError),
    ("eb-nan", dict(decoding_strategy="block_diffusion", eb_threshold=NAN), "eb_threshold", ValueError),
    ("eb-inf", dict(decoding_strategy="block_diffusion", eb_threshold=INF), "eb_threshold", ValueError),
    # S2D2 parameters that would be ignored: the random rule's under greedy_match, a span no block holds
    ("s2d2-no-resample-greedy", dict(decoding_strategy="s2d2", allow_resample=False), "allow_resample", ValueError),
    ("s2d2-tempering-greedy", dict(decoding_strategy="s2d2", ssd_ratio_tempering_factor=0.5),
     "ssd_ratio_tempering_factor", ValueError),
    ("s2d2-span-beyond-block", dict(decoding_strategy="s2d2", block_size=4, min_ssd_span_length=5),
     "min_ssd_span_length", ValueError),
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
    # a block larger than the whole sequence (7 + 16 -> 32): its tail beyond the budget would be denoised for nothing
    ("block-size-beyond-budget", dict(decoding_strategy="block_diffusion", block_size=128, max_new_tokens=16),
     "block_size", ValueError),
    ("block-size-beyond-budget-s2d2", dict(decoding_strategy="s2d2", block_size=64, max_new_tokens=8), "block_size",
     ValueError),
    ("steps-beyond-explicit-block", dict(decoding_strategy="block_diffusion", block_size=4, steps_per_block=8),
     "steps_per_block", ValueError),
    ("max-new-tokens-float", dict(decoding_strategy="s2d2", max_new_tokens=2.5), "max_new_tokens", ValueError),
    ("max-new-tokens-str", dict(decoding_strategy="s2d2", max_new_tokens="8"), "max_new_tokens", ValueError),
    ("max-new-tokens-zero", dict(decoding_strategy="s2d2", max_new_tokens=0), "max_new_tokens", ValueError),
    ("max-length-below-prompt", dict(decoding_strategy="s2d2", max_new_tokens=None, max_length=3), "max_length",
     ValueError),
    ("max-length-the-prompt", dict(decoding_strategy="s2d2", max_new_tokens=None, max_length=len(PROMPT[0])),
     "max_length", ValueError),                                   # room for no new token
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
    ("ids-meta", dict(decoding_strategy="s2d2", input_ids=torch.tensor(PROMPT, device="meta")), "input_ids",
     ValueError),
    ("inputs-embeds", dict(decoding_strategy="s2d2", input_ids=None, inputs_embeds=torch.zeros(1, 7, 32)),
     "inputs_embeds", ValueError),
    ("inputs-embeds-with-ids", dict(decoding_strategy="s2d2", inputs_embeds=torch.zeros(1, 7, 32)), "inputs_embeds",
     ValueError),
    # special tokens
    ("mask-beyond-vocab", dict(decoding_strategy="s2d2", mask_token_id=99), "mask_token_id", ValueError),
    ("mask-negative", dict(decoding_strategy="s2d2", mask_token_id=-1), "mask_token_id", ValueError),
    ("mask-is-stop-id", dict(decoding_strategy="s2d2", mask_token_id=7, eos_token_id=7), "mask_token_id",
     ValueError),
    ("eos-beyond-vocab", dict(decoding_strategy="s2d2", eos_token_id=1000), "eos_token_id", ValueError),
    ("pad-beyond-vocab", dict(decoding_strategy="s2d2", pad_token_id=1000), "pad_token_id", ValueError),
    ("mask-float", dict(decoding_strategy="s2d2", mask_token_id=97.6), "mask_token_id", ValueError),   # never int()
    ("mask-str", dict(decoding_strategy="s2d2", mask_token_id="98"), "mask_token_id", ValueError),
    ("mask-bool", dict(decoding_strategy="s2d2", mask_token_id=True), "mask_token_id", ValueError),
    # generation options transformers knows but the strategies do not support
    ("num-beams", dict(decoding_strategy="s2d2", num_beams=2), "num_beams", ValueError),
    ("num-return-sequences", dict(decoding_strategy="s2d2", num_return_sequences=2), "num_return_sequences",
     ValueError),
    ("output-scores", dict(decoding_strategy="s2d2", output_scores=True, return_dict_in_generate=True),
     "output_scores", ValueError),
    ("cache-offloaded", dict(decoding_strategy="s2d2", cache_implementation="offloaded"), "cache_implementation",
     ValueError),
    # transformers switched "paged" to its own continuous batching (the strategy never ran) and failed on "quantized"
    # with an ImportError; both are refused before transformers prepares the cache
    ("cache-paged", dict(decoding_strategy="s2d2", cache_implementation="paged"), "cache_implementation", ValueError),
    ("cache-paged-in-config", dict(decoding_strategy="s2d2", generation_config=GenerationConfig(
        cache_implementation="paged")), "cache_implementation", ValueError),
    # options that select another of transformers' decoding modes, which the strategy replaces (they were ignored)
    ("contrastive-search", dict(decoding_strategy="s2d2", penalty_alpha=0.6, top_k=4), "penalty_alpha", ValueError),
    ("dola", dict(decoding_strategy="s2d2", dola_layers="low"), "dola_layers", ValueError),
    ("prompt-lookup", dict(decoding_strategy="ar", prompt_lookup_num_tokens=3), "prompt_lookup_num_tokens",
     ValueError),
    ("early-exit", dict(decoding_strategy="s2d2", assistant_early_exit=1), "assistant_early_exit", ValueError),
    ("force-words", dict(decoding_strategy="s2d2", force_words_ids=[[5]]), "force_words_ids", ValueError),
    # set by transformers on the assistant of its assisted decoding; its criterion read scores the loop has not
    ("is-assistant", dict(decoding_strategy="s2d2", is_assistant=True), "is_assistant", ValueError),
    # transformers' chunked prefill: each strategy prefills in one forward, so the chunk size was ignored
    ("deer-draft-block-size", dict(decoding_strategy="deer", draft_block_size=3), "draft_block_size", ValueError),
    ("prefill-chunk-size", dict(decoding_strategy="s2d2", prefill_chunk_size=2), "prefill_chunk_size", ValueError),
    ("prefill-chunk-size-ar", dict(decoding_strategy="ar", prefill_chunk_size=2), "prefill_chunk_size", ValueError),
    ("streamer-list", dict(decoding_strategy="s2d2", streamer=[None]), "streamer", ValueError),   # no put / end
    ("cache-quantized", dict(decoding_strategy="s2d2", cache_implementation="quantized"), "cache_implementation",
     ValueError),
    # transformers compares `max_cache_len` with the call's length unchecked (a TypeError for a string); 10**7
    # columns were allocated (killed for memory) on a model of 256 positions
    ("max-cache-len-beyond-positions", dict(decoding_strategy="s2d2", cache_implementation="static",
                                            max_cache_len=10 ** 7), "max_cache_len", ValueError),
    # a stored strategy that is not the dict `save_to_generation_config` writes: an AttributeError, or ignored
    ("stored-not-a-dict", dict(decoding_strategy="s2d2", generation_config=_stored("s2d2")),
     "generation_config.dllm_decoding", ValueError),
    ("stored-without-a-name", dict(generation_config=_stored({"block_size": 4})), "generation_config.dllm_decoding",
     ValueError),
    ("preset-a-list", dict(decoding_strategy="s2d2", preset=["sdar-1.7b-config-a"]), "preset", ValueError),
    ("preset-of-another-strategy", dict(decoding_strategy="block_diffusion", preset="sdar-1.7b-config-a"), "preset",
     ValueError),
    ("max-cache-len-zero", dict(decoding_strategy="s2d2", cache_implementation="static", max_cache_len=0),
     "max_cache_len", ValueError),
    ("max-cache-len-str", dict(decoding_strategy="s2d2", cache_implementation="static", max_cache_len="4096"),
     "max_cache_len", ValueError),
    ("repetition-penalty", dict(decoding_strategy="s2d2", repetition_penalty=1.3), "repetition_penalty",
     NotImplementedError),
    # transformers adds a `min_length` processor for `min_new_tokens` too: the option the user set is named
    ("min-new-tokens", dict(decoding_strategy="s2d2", min_new_tokens=4, eos_token_id=7), "min_new_tokens",
     NotImplementedError),
    ("min-length-beyond-the-prompt", dict(decoding_strategy="s2d2", min_length=len(PROMPT[0]) + 1, eos_token_id=7),
     "min_length", NotImplementedError),
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
    # transformers derives `position_ids` from the mask and drops an all-ones mask: the mask is named, not positions
    ("attention-mask-short-all-ones", dict(decoding_strategy="s2d2", attention_mask=torch.ones(1, 5, dtype=torch.long)),
     "attention_mask", ValueError),
    ("attention-mask-long-all-ones", dict(decoding_strategy="s2d2", attention_mask=torch.ones(1, 9, dtype=torch.long)),
     "attention_mask", ValueError),
    ("attention-mask-batch-2", dict(decoding_strategy="s2d2", attention_mask=torch.ones(2, 7, dtype=torch.long)),
     "attention_mask", ValueError),
    ("attention-mask-1d", dict(decoding_strategy="s2d2", attention_mask=torch.ones(7, dtype=torch.long)),
     "attention_mask", ValueError),
    ("attention-mask-values-2", dict(decoding_strategy="s2d2", attention_mask=torch.full((1, 7), 2)), "attention_mask",
     ValueError),
    ("attention-mask-values-float", dict(decoding_strategy="s2d2", attention_mask=torch.full((1, 7), 0.5)),
     "attention_mask", ValueError),
    ("attention-mask-list", dict(decoding_strategy="s2d2", attention_mask=[[1] * 7]), "attention_mask", ValueError),
    ("attention-mask-meta", dict(decoding_strategy="s2d2", attention_mask=torch.ones(1, 7, device="meta")),
     "attention_mask", ValueError),
    ("position-ids-meta", dict(decoding_strategy="s2d2", position_ids=torch.arange(7, device="meta")[None]),
     "position_ids", ValueError),
    # drafters
    ("assistant-for-self-speculation", dict(decoding_strategy="s2d2", assistant_model="<model>"), "assistant_model",
     ValueError),
    ("draft-for-self-speculation", dict(decoding_strategy="s2d2", draft_model="<model>"), "draft_model", ValueError),
    ("draft-on-meta", dict(decoding_strategy="simsd", draft_model="<meta>"), "draft_model", ValueError),
    ("assistant-on-meta", dict(decoding_strategy="simsd", assistant_model="<meta>"), "assistant_model", ValueError),
    # not loaded: a path (an AttributeError from the raw-call checks before)
    ("assistant-a-path", dict(decoding_strategy="simsd", assistant_model="models/deer-drafter-tiny"), "assistant_model",
     ValueError),
    ("draft-a-path", dict(decoding_strategy="simsd", draft_model="models/deer-drafter-tiny"), "draft_model",
     ValueError),
    # batches
    ("streamer-batch", dict(decoding_strategy="s2d2", input_ids=torch.tensor(PROMPT * 2), pad_token_id=0,
                            streamer=_NullStreamer()), "streamer", ValueError),
    ("generator-other-device", dict(decoding_strategy="s2d2", generator=_CudaGenerator()), "generator", ValueError),
    # per-row generators: one torch.Generator per row, on the model's device
    ("generator-list-too-long", dict(decoding_strategy="s2d2", generator=[torch.Generator(), torch.Generator()]),
     "generator", ValueError),
    ("generator-list-too-short", dict(decoding_strategy="s2d2", input_ids=torch.tensor(PROMPT * 2), pad_token_id=0,
                                      generator=[torch.Generator()]), "generator", ValueError),
    ("generator-empty-tuple", dict(decoding_strategy="s2d2", generator=()), "generator", ValueError),
    ("generator-list-int", dict(decoding_strategy="s2d2", input_ids=torch.tensor(PROMPT * 2), pad_token_id=0,
                                generator=[torch.Generator(), 3]), "generator[1]", ValueError),
    ("generator-list-other-device", dict(decoding_strategy="s2d2", input_ids=torch.tensor(PROMPT * 2), pad_token_id=0,
                                         generator=[_CudaGenerator(), torch.Generator()]), "generator[0]", ValueError),
]


#: Cases whose error names the argument under another name it goes by.
SUBJECTS = {"assistant_model": ("assistant_model", "draft_model")}


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
        elif kwargs.get(key) == "<meta>":
            kwargs[key] = _meta_model()
    kwargs.setdefault("max_new_tokens", 8)
    if kwargs["max_new_tokens"] is None:
        kwargs.pop("max_new_tokens")
    return model.generate(ids, **kwargs) if ids is not None else model.generate(**kwargs)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_caught_before_any_forward(counted, case):
    _, kwargs, name, error = case
    model, calls = counted
    calls.clear()
    with pytest.raises(error) as info:
        _run(model, kwargs)
    subject = str(info.value).split("`")[1]                      # the library's format: "`name` (=value) must ..."
    assert str(info.value).startswith("`") and subject in SUBJECTS.get(name, (name,)), str(info.value)
    assert f"`{name}`" in str(info.value), str(info.value)
    assert not calls, f"{len(calls)} forward(s) ran before the error"


def test_catalogue_size():
    assert len(CASES) + len(MODEL_CASES) >= 50


def _meta_model():
    with torch.device("meta"):
        return SDARForCausalLM(SDARConfig(block_size=4, mask_token_id=MASK_ID, **TINY)).eval()


def _meta_qwen():
    with torch.device("meta"):
        return Qwen2ForCausalLM(Qwen2Config(**{k: v for k, v in TINY.items() if k != "head_dim"})).eval()


MODEL_CASES = [
    ("model-on-meta", _meta_model, dict(decoding_strategy="s2d2"), "model"),
    # a plain transformers model: transformers prepares the call before hf_dllm_spec's callable sees the model
    ("model-on-meta-custom-generate", _meta_qwen, dict(custom_generate=hf_dllm_spec.custom_generate,
                                                       decoding_strategy="ar"), "model"),
]


@pytest.mark.parametrize("case", MODEL_CASES, ids=[c[0] for c in MODEL_CASES])
def test_bad_model_is_caught(case):
    _, build, kwargs, name = case
    with pytest.raises(ValueError) as info:
        _run(build(), kwargs)
    assert f"`{name}`" in str(info.value), str(info.value)


def test_direct_callable_call_refuses_the_cache_in_its_generation_config(counted):
    """A direct call of the callable checks its `generation_config` before transformers prepares the call."""
    model, calls = counted
    calls.clear()
    with pytest.raises(ValueError, match=r"`cache_implementation` \(='paged'\)"):
        hf_dllm_spec.custom_generate(model, torch.tensor(PROMPT), decoding_strategy="s2d2", max_new_tokens=8,
                                     generation_config=GenerationConfig(cache_implementation="paged"))
    assert not calls


def test_direct_callable_call_refuses_a_streamer_without_put_and_end(counted):
    """transformers sends the prompt to the streamer before the callable runs: the raw call checks it first."""
    model, calls = counted
    calls.clear()
    with pytest.raises(ValueError, match=r"`streamer` \(='list'\) must have transformers' streamer methods"):
        hf_dllm_spec.custom_generate(model, torch.tensor(PROMPT), decoding_strategy="s2d2", max_new_tokens=8,
                                     streamer=[None])
    assert not calls


def test_custom_generate_path_checks_the_same(counted):
    """The plain transformers entry point (`custom_generate=`) runs the same checks."""
    model, calls = counted
    calls.clear()
    with pytest.raises(ValueError, match="`confidence_threshold`"):
        super(SDARForCausalLM, model).generate(torch.tensor(PROMPT), custom_generate=hf_dllm_spec.custom_generate,
                                               decoding_strategy="s2d2", confidence_threshold=NAN, max_new_tokens=8)
    assert not calls


@pytest.mark.parametrize("option", [dict(min_new_tokens=0), dict(min_length=1), dict(min_length=len(PROMPT[0]))])
def test_length_options_that_act_on_no_position_are_accepted(sdar_model, option):
    """`min_new_tokens=0`, or a `min_length` no longer than the prompt, make transformers add a length processor that
    masks no position (stock `generate` leaves the tokens as they are): accepted, same tokens (they were refused)."""
    kwargs = dict(decoding_strategy="s2d2", max_new_tokens=8, eos_token_id=7)
    plain = sdar_model.generate(torch.tensor(PROMPT), **kwargs)
    assert torch.equal(sdar_model.generate(torch.tensor(PROMPT), **kwargs, **option), plain)


def test_length_options_that_act_on_no_position_pass_the_assisted_path_too(pair_models):
    """transformers' assisted decoding with DEER's drafter (`deer_assisted_generate`) takes `min_new_tokens=0` as
    `custom_generate` does (it refused it, naming `min_length`)."""
    models, _ = pair_models
    kwargs = dict(num_draft_tokens=4, max_new_tokens=8)
    plain = hf_dllm_spec.deer_assisted_generate(models["ar"], torch.tensor(PROMPT), models["drafter"], **kwargs)
    got = hf_dllm_spec.deer_assisted_generate(models["ar"], torch.tensor(PROMPT), models["drafter"], min_new_tokens=0,
                                              **kwargs)
    assert torch.equal(got, plain)


@pytest.mark.parametrize("strategy", ["block_diffusion", "s2d2", "deer"])
def test_a_cache_used_by_an_earlier_call_is_refused_before_any_forward(counted, pair_models, strategy):
    """The multi-turn habit of passing one `DynamicCache` to every call: the first call decodes as without it; the
    second is refused naming the cache (it failed inside transformers after a forward: the first call had left
    the cache with no rows, `get_seq_length() == 0`)."""
    from transformers import DynamicCache

    from model_patches.compat import CACHE_KWARG

    if strategy == "deer":
        models, calls = pair_models
        model, extra = models["ar"], dict(custom_generate=hf_dllm_spec.custom_generate, draft_model=models["drafter"])
    else:
        (model, calls), extra = counted, {}
    kwargs = dict(decoding_strategy=strategy, max_new_tokens=6, eos_token_id=None, **extra)
    cache = DynamicCache(config=model.config)
    plain = model.generate(torch.tensor(PROMPT), **kwargs)
    assert torch.equal(model.generate(torch.tensor(PROMPT), **kwargs, **{CACHE_KWARG: cache}), plain)
    calls.clear()
    with pytest.raises(ValueError, match=rf"^`{CACHE_KWARG}` \(='<DynamicCache of 0 tokens, used before>'\) must be "
                                         "a new, empty cache"):
        model.generate(torch.tensor(PROMPT), **kwargs, **{CACHE_KWARG: cache})
    assert not calls


def test_exact_allowed_processor_still_runs(sdar_model):
    """The allow-list is by exact class: the stock warper is accepted, and it warps as `temperature=` does."""
    common = dict(decoding_strategy="s2d2", max_new_tokens=8, do_sample=True, eos_token_id=None)
    passed = sdar_model.generate(torch.tensor(PROMPT), **common,
                                 logits_processor=LogitsProcessorList([TemperatureLogitsWarper(0.7)]),
                                 generator=torch.Generator().manual_seed(0))
    keyword = sdar_model.generate(torch.tensor(PROMPT), **common, temperature=0.7,
                                  generator=torch.Generator().manual_seed(0))
    plain = sdar_model.generate(torch.tensor(PROMPT), **common, generator=torch.Generator().manual_seed(0))
    assert passed.tolist() == keyword.tolist() != plain.tolist()


def test_consistent_position_ids_are_accepted(sdar_model):
    ids = torch.tensor(PROMPT)
    a = sdar_model.generate(ids, decoding_strategy="s2d2", max_new_tokens=6)
    b = sdar_model.generate(ids, decoding_strategy="s2d2", max_new_tokens=6, position_ids=torch.arange(7)[None])
    assert torch.equal(a, b)


def test_stopping_criteria_list_is_accepted(sdar_model):
    out = sdar_model.generate(torch.tensor(PROMPT), decoding_strategy="s2d2", max_new_tokens=6,
                              stopping_criteria=StoppingCriteriaList())
    assert out.shape[1] <= len(PROMPT[0]) + 6


# -- drafter pairs (DEER: AR target + SDAR drafter; SimSD: two SDAR models) ---------------------------------------
def _qwen2(seed: int = 1, **overrides) -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(Qwen2Config(**{k: v for k, v in {**TINY, **overrides}.items() if k != "head_dim"})).eval()


def _sdar(seed: int, **overrides) -> SDARForCausalLM:
    torch.manual_seed(seed)
    return SDARForCausalLM(SDARConfig(block_size=4, mask_token_id=MASK_ID, **{**TINY, **overrides})).eval()


@pytest.fixture(scope="module")
def pair_models():
    """An AR target (DEER), an SDAR target (SimSD) and an SDAR drafter (mask 98), each with a forward counter; and,
    for the kinds a strategy declares, a Fast-dLLM v2 and a LLaDA2 model and a position-aligned Qwen3."""
    family = tiny_family_models()
    family["qwen"].config.dllm_alignment = "position"            # diffusion weights in the Qwen layout
    models = {"ar": _qwen2(), "sdar": _sdar(0), "drafter": _sdar(7), "fast": family["fast"],
              "llada2": family["llada2"], "qwen-position": family["qwen"]}
    calls = []
    handles = [m.register_forward_pre_hook(lambda module, args: calls.append(1)) for m in models.values()]
    yield models, calls
    for handle in handles:
        handle.remove()


def _pair_generate(models, strategy, target=None, **kwargs):
    kwargs.setdefault("max_new_tokens", 8)
    kwargs.setdefault("draft_model", models["drafter"])
    if strategy == "simsd" and target is None:
        return models["sdar"].generate(torch.tensor(PROMPT), decoding_strategy="simsd", **kwargs)
    return models[target or "ar"].generate(torch.tensor(PROMPT), custom_generate=hf_dllm_spec.custom_generate,
                                           decoding_strategy=strategy, **kwargs)


#: (case id, strategy, generate keyword arguments, argument the message must name)
DRAFTER_CASES = [
    (f"{strategy}-{case}", strategy, kwargs, name)
    for strategy in ("deer", "simsd")
    for case, kwargs, name in [
        ("draft-mask-beyond-vocab", dict(draft_mask_token_id=150), "draft_mask_token_id"),
        ("draft-mask-negative", dict(draft_mask_token_id=-1), "draft_mask_token_id"),
        ("draft-mask-float", dict(draft_mask_token_id=98.2), "draft_mask_token_id"),
        ("draft-mask-is-stop-id", dict(draft_mask_token_id=7, eos_token_id=7), "draft_mask_token_id"),
        ("drafter-on-meta", dict(draft_model="<meta>"), "draft_model"),
        ("drafter-of-another-vocabulary", dict(draft_model="<vocab 120>"), "draft_model"),
    ]
] + [
    ("deer-drafter-own-mask-is-stop-id", "deer", dict(eos_token_id=[3, MASK_ID]), "draft_mask_token_id"),
    ("deer-sep-beyond-vocab", "deer", dict(sep_token_id=150), "sep_token_id"),
    ("deer-drafter-a-path", "deer", dict(draft_model="models/deer-drafter-tiny"), "draft_model"),   # not loaded
    # the AR target decodes without a mask token: the id was suppressed from its distribution (not lossless)
    ("deer-target-mask-token", "deer", dict(mask_token_id=5), "mask_token_id"),
    ("deer-sep-is-the-drafter-mask", "deer", dict(sep_token_id=MASK_ID), "sep_token_id"),
    ("deer-assistant-on-meta", "deer", dict(draft_model=None, assistant_model="<meta>"), "draft_model"),
    # the kinds each strategy declares (`target_kind`, `drafter_kind`), checked by the plan
    ("deer-diffusion-target", "deer", dict(target="sdar"), "model"),
    ("deer-right-shifted-diffusion-target", "deer", dict(target="fast"), "model"),
    ("deer-position-aligned-ar-target", "deer", dict(target="qwen-position"), "model"),
    ("simsd-ar-target", "simsd", dict(target="ar"), "model"),
    ("simsd-ar-drafter", "simsd", dict(draft_model="<ar>"), "draft_model"),
    ("simsd-drafter-of-another-family", "simsd", dict(draft_model="<fast>"), "draft_model"),
    ("simsd-drafter-of-another-family-same-alignment", "simsd", dict(draft_model="<llada2>"), "draft_model"),
    ("simsd-drafter-of-another-alignment", "simsd", dict(draft_model="<right-shifted sdar>"), "draft_model"),
    ("simsd-no-drafter", "simsd", dict(draft_model=None), "draft_model"),
    # refused for its target first (for a missing mask token, block size or drafter before)
    ("simsd-ar-target-no-drafter", "simsd", dict(target="ar", draft_model=None), "model"),
]

_AR_RULE = ("be an autoregressive causal LM (right-shifted, not a diffusion LM; e.g. Qwen2/Qwen3) for "
            "decoding_strategy='deer'",
            "pass the AR model as the model and the diffusion model as draft_model=")
_DIFFUSION_RULE = ("be a diffusion LM for decoding_strategy='simsd'", "of one family for both")
_FAMILY_RULE = ("be of the target's family (SDAR) and alignment",)
#: What each kind case's message states (its rule and fix).
KIND_RULES = {"deer-diffusion-target": _AR_RULE, "deer-right-shifted-diffusion-target": _AR_RULE,
              "deer-position-aligned-ar-target": _AR_RULE, "simsd-ar-target": _DIFFUSION_RULE,
              "simsd-ar-drafter": _DIFFUSION_RULE, "simsd-drafter-of-another-family": _FAMILY_RULE,
              "simsd-drafter-of-another-family-same-alignment": _FAMILY_RULE,
              "simsd-drafter-of-another-alignment": _FAMILY_RULE,
              "simsd-no-drafter": ("be given for decoding_strategy='simsd'",),
              "simsd-ar-target-no-drafter": _DIFFUSION_RULE}


@pytest.mark.parametrize("case", DRAFTER_CASES, ids=[c[0] for c in DRAFTER_CASES])
def test_bad_drafter_input_is_caught_before_any_forward(pair_models, case):
    """Drafter-side ids, the drafter's weights and vocabulary: the library's error before the first forward of either
    model (the ids failed with an IndexError after 2-3 forwards, a meta drafter after the target's prefill)."""
    _, strategy, kwargs, name = case
    models, calls = pair_models
    kwargs = dict(kwargs)
    for key in ("draft_model", "assistant_model"):
        if kwargs.get(key) == "<meta>":
            kwargs[key] = _meta_model()
        elif kwargs.get(key) == "<vocab 120>":
            kwargs[key] = _sdar(2, vocab_size=120)
        elif kwargs.get(key) == "<ar>":
            kwargs[key] = models["ar"]
        elif kwargs.get(key) in ("<fast>", "<llada2>"):
            kwargs[key] = models[kwargs[key].strip("<>")]
        elif kwargs.get(key) == "<right-shifted sdar>":
            kwargs[key] = _sdar(7)
            kwargs[key].config.dllm_alignment = "right_shift"
    calls.clear()
    with pytest.raises(ValueError) as info:
        _pair_generate(models, strategy, **kwargs)
    assert str(info.value).startswith(f"`{name}`"), str(info.value)
    assert all(part in str(info.value) for part in KIND_RULES.get(case[0], ())), str(info.value)
    assert not calls, f"{len(calls)} forward(s) ran before the error"


@pytest.mark.parametrize("strategy", ["deer", "simsd"])
def test_per_call_stop_list_applies_to_both_models(pair_models, strategy):
    """A per-call `eos_token_id` list is legitimate (stock `generate` takes it) even when the drafter's own config
    names another stop id: it is not compared with the drafter's, and both models stop on it."""
    models, _ = pair_models
    free = _pair_generate(models, strategy, max_new_tokens=12, eos_token_id=None)[0, len(PROMPT[0]):].tolist()
    stops = [free[4], 97 if free[4] != 97 else 96]                  # the 5th token ends the output
    drafter = models["drafter"]
    drafter.generation_config.eos_token_id = 3 if 3 not in stops else 2
    try:
        out = _pair_generate(models, strategy, max_new_tokens=12, eos_token_id=stops)[0, len(PROMPT[0]):].tolist()
    finally:
        drafter.generation_config.eos_token_id = None
    assert out == free[:free.index(stops[0]) + 1]
    if strategy == "deer":                                          # lossless: the target's own greedy output
        stock = models["ar"].generate(torch.tensor(PROMPT), max_new_tokens=12, do_sample=False, eos_token_id=stops)
        assert out == stock[0, len(PROMPT[0]):].tolist()


@pytest.mark.parametrize("strategy", ["deer", "simsd"])
def test_per_call_pad_id_applies_to_both_models_and_a_drafters_own_other_pad_id_is_refused(pair_models, strategy):
    """`pad_token_id=tokenizer.eos_token_id` per call (a common habit; stock assisted generation takes it) was refused
    as a drafter of another tokenizer; a drafter whose own pad id differs from the target's still is."""
    models, calls = pair_models
    target, drafter = models["ar" if strategy == "deer" else "sdar"], models["drafter"]
    before = target.generation_config.pad_token_id, drafter.generation_config.pad_token_id
    target.generation_config.pad_token_id = drafter.generation_config.pad_token_id = 0
    try:
        plain = _pair_generate(models, strategy, eos_token_id=None)
        assert torch.equal(_pair_generate(models, strategy, eos_token_id=None, pad_token_id=9), plain)
        drafter.generation_config.pad_token_id = 9
        calls.clear()
        with pytest.raises(ValueError, match=r"^`draft_model` \(='<pad_token_id=9>'\) must use the target's"):
            _pair_generate(models, strategy, eos_token_id=None)
        assert not calls
        # the call's pad id is what both models use: the drafter's own 9 against the target's own 0 is not compared
        assert torch.equal(_pair_generate(models, strategy, eos_token_id=None, pad_token_id=9), plain)
    finally:
        target.generation_config.pad_token_id, drafter.generation_config.pad_token_id = before


def test_large_deer_block_is_not_refused(pair_models):
    """DEER's block size is k, the drafts per cycle, never beyond the budget: no whole block is denoised."""
    models, _ = pair_models
    out = _pair_generate(models, "deer", block_size=64, max_new_tokens=6, eos_token_id=None)
    assert out.shape[1] == len(PROMPT[0]) + 6


def test_block_size_budget_rule():
    """Refused: a block larger than the whole sequence rounded up to a power of two; the trained size always runs."""
    from hf_dllm_spec.integration.plan import check_block_budget

    check_block_budget(32, 4, [7], 16)                # 7 + 16 = 23 -> 32
    check_block_budget(16, 4, [7], 4)                 # 11 -> 16
    check_block_budget(64, 64, [7], 4)                # the checkpoint's trained size
    with pytest.raises(ValueError, match=r"^`block_size` \(=2048\) must be at most 32"):
        check_block_budget(2048, 4, [7], 16)
    with pytest.raises(ValueError, match=r"^`block_size` \(=32\) must be at most 16"):
        check_block_budget(32, None, [3, 20], 8)      # the shortest row: 11 -> 16 (each row alone decides)
    check_block_budget(32, None, [20], 8)             # that row alone: 28 -> 32
    check_block_budget(16, None, [8], 8)              # a power of two is its own bound: 16 -> 16
    with pytest.raises(ValueError, match=r"^`block_size` \(=32\) must be at most 16"):
        check_block_budget(32, None, [8], 8)


def test_deer_assisted_generate_checks_the_drafter_first(pair_models):
    """transformers' assisted decoding would advise an `assistant_tokenizer` for a drafter of another vocabulary;
    the library's own checks come first (either model's weights, the target's kind), and the drafter's ids are
    checked before any forward."""
    models, calls = pair_models
    ids = torch.tensor(PROMPT)
    cases = [
        (dict(draft_model=_sdar(2, vocab_size=120)), "draft_model"),
        (dict(draft_model=_meta_model()), "draft_model"),
        (dict(draft_model="models/deer-drafter-tiny"), "draft_model"),               # a path, not loaded
        (dict(target=_meta_qwen()), "model"),                                         # never loaded
        (dict(target="models/qwen2-tiny-ar"), "model"),
        (dict(target=models["sdar"]), "model"),                                       # not autoregressive
        (dict(draft_model=models["drafter"], mask_token_id=150), "mask_token_id"),
        (dict(draft_model=models["drafter"], mask_token_id=2.5), "mask_token_id"),
        (dict(draft_model=models["drafter"], sep_token_id=150), "sep_token_id"),
        (dict(draft_model=models["drafter"], eos_token_id=MASK_ID), "mask_token_id"),
    ]
    for kwargs, name in cases:
        calls.clear()
        target = kwargs.pop("target", models["ar"])
        kwargs.setdefault("draft_model", models["drafter"])
        with pytest.raises(ValueError) as info:
            hf_dllm_spec.deer_assisted_generate(target, ids, num_draft_tokens=4, max_new_tokens=8, **kwargs)
        assert str(info.value).startswith(f"`{name}`"), str(info.value)
        assert not calls, f"{len(calls)} forward(s) ran before the error"


# -- the plain transformers entry point (`custom_generate=` on a model without hf_dllm_spec's generate) -----------
@pytest.mark.parametrize("mask", [torch.ones(1, 5, dtype=torch.long), torch.full((1, 7), 2),
                                  torch.ones(2, 7, dtype=torch.long)], ids=["short-all-ones", "values-2", "batch-2"])
def test_attention_mask_is_named_on_the_custom_generate_path(qwen_model, mask):
    """transformers derives `position_ids` from the mask and drops an all-ones mask before calling the callable: the
    mask as given is read from the call and named (it was blamed on `position_ids`, never passed)."""
    calls = []
    handle = qwen_model.register_forward_pre_hook(lambda module, args: calls.append(1))
    try:
        with pytest.raises(ValueError, match=r"^`attention_mask`"):
            qwen_model.generate(torch.tensor(PROMPT), custom_generate=hf_dllm_spec.custom_generate,
                                decoding_strategy="block_diffusion", block_size=4, mask_token_id=MASK_ID,
                                max_new_tokens=8, attention_mask=mask)
    finally:
        handle.remove()
    assert not calls


def test_inputs_embeds_is_named_on_the_custom_generate_path(qwen_model):
    with pytest.raises(ValueError, match=r"^`inputs_embeds` .* pass `input_ids`"):
        qwen_model.generate(inputs_embeds=torch.zeros(1, 7, 32), custom_generate=hf_dllm_spec.custom_generate,
                            decoding_strategy="block_diffusion", block_size=4, mask_token_id=MASK_ID, max_new_tokens=8)


@pytest.fixture(scope="module")
def tokenizer():
    from pathlib import Path

    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(Path(__file__).resolve().parents[1] / "models" / "sdar-tiny-arith")


def test_stop_strings_with_tokenizer_on_the_custom_generate_path(sdar_model, qwen_model, tokenizer):
    """transformers drops `tokenizer` before calling a custom_generate callable (and refused `stop_strings` with "could
    not locate a tokenizer"): the callable takes `stop_strings` and reads the tokenizer from the call. `qwen_model`
    holds `sdar_model`'s weights: the plain model's callable path, a direct call and the model class agree."""
    ids = torch.tensor(PROMPT)
    common = dict(decoding_strategy="block_diffusion", block_size=4, max_new_tokens=16, eos_token_id=None)
    free = sdar_model.generate(ids, **common)[0, ids.shape[1]:]
    stop = tokenizer.decode(free[5:6])
    assert stop.strip(), f"token {int(free[5])} decodes to whitespace"
    by_class = sdar_model.generate(ids, stop_strings=[stop], tokenizer=tokenizer, **common)
    assert by_class.shape[1] < ids.shape[1] + 16
    callable_path = qwen_model.generate(ids, custom_generate=hf_dllm_spec.custom_generate, mask_token_id=MASK_ID,
                                        stop_strings=[stop], tokenizer=tokenizer, **common)
    direct = hf_dllm_spec.custom_generate(qwen_model, ids, mask_token_id=MASK_ID, stop_strings=[stop],
                                          tokenizer=tokenizer, **common)
    assert torch.equal(callable_path, by_class) and torch.equal(direct, by_class)
    with pytest.raises(ValueError, match=r"^`stop_strings` .* must come with `tokenizer`"):
        qwen_model.generate(ids, custom_generate=hf_dllm_spec.custom_generate, mask_token_id=MASK_ID,
                            stop_strings=[stop], **common)
