"""Streaming: final tokens reach a transformers streamer as they become final, on all three entry points.

A `TextIteratorStreamer` consumed in a thread must finish (its `end()` is always called) and its text must
equal the returned text. Bundled trained model and tokenizer, greedy, CPU.
"""

from __future__ import annotations

import pathlib
import threading

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, TextIteratorStreamer

import hf_dllm_spec
from conftest import no_cyclic_garbage

ROOT = pathlib.Path(__file__).resolve().parents[1]
MODEL_DIR = ROOT / "models" / "sdar-tiny-arith"
PROMPT = "Question: Tom has 12 apples. Tom gets 7 more apples. How many apples does Tom have now?\nAnswer:"


@pytest.fixture(scope="module")
def bundled():
    tokenizer = AutoTokenizer.from_pretrained(MODEL_DIR)
    model = AutoModelForCausalLM.from_pretrained(MODEL_DIR, dtype=torch.float32).eval()
    return tokenizer, model, tokenizer(PROMPT, return_tensors="pt").input_ids


ENTRY_POINTS = {
    "model_class": lambda model, ids, **kw: model.generate(ids, **kw),
    "callable": lambda model, ids, **kw: model.generate(ids, custom_generate=hf_dllm_spec.custom_generate, **kw),
    "hub_folder": lambda model, ids, **kw: model.generate(ids, custom_generate=str(ROOT), trust_remote_code=True,
                                                          **kw),
}


@pytest.mark.parametrize("entry", list(ENTRY_POINTS))
@pytest.mark.parametrize("strategy,kwargs", [
    ("s2d2", {"block_size": 16, "min_ssd_span_length": 1, "cache_ver": True, "draft_ver": True}),
    ("block_diffusion", {"block_size": 4}),
    ("ar", {}),
])
def test_text_iterator_streamer_finishes_with_the_returned_text(bundled, entry, strategy, kwargs):
    tokenizer, model, ids = bundled
    streamer = TextIteratorStreamer(tokenizer, skip_prompt=True, timeout=20)
    result = {}

    def run():
        result["out"] = ENTRY_POINTS[entry](model, ids, decoding_strategy=strategy, max_new_tokens=24,
                                            streamer=streamer, **kwargs)

    with no_cyclic_garbage(f"{entry}, {strategy}, streamed"):    # every entry point, frames read included
        thread = threading.Thread(target=run)
        thread.start()
        streamed = "".join(streamer)          # ends only when the producer calls end()
        thread.join(timeout=60)
    assert not thread.is_alive()
    returned = tokenizer.decode(result["out"][0, ids.shape[1]:])
    assert streamed == returned and returned


@pytest.mark.parametrize("entry", list(ENTRY_POINTS))
def test_simsd_streams_its_committed_prefix(bundled, entry):
    """SimSD with the bundled model drafting for itself: every cycle's committed prefix reaches the streamer."""
    tokenizer, model, ids = bundled
    streamer = Recorder()
    out = ENTRY_POINTS[entry](model, ids, decoding_strategy="simsd", draft_model=model, max_new_tokens=24,
                              streamer=streamer)
    assert streamer.ended == 1 and streamer.chunks[0] == ids[0].tolist()
    assert sum(streamer.chunks[1:], []) == out[0, ids.shape[1]:].tolist()
    assert len(streamer.chunks) > 3


class Recorder:
    def __init__(self):
        self.chunks, self.ended = [], 0

    def put(self, value):
        self.chunks.append(value.reshape(-1).tolist())

    def end(self):
        self.ended += 1


@pytest.mark.parametrize("entry", list(ENTRY_POINTS))
def test_prompt_once_then_final_chunks_then_end(bundled, entry):
    """S2D2 streams each accepted left-contiguous prefix: more chunks than blocks, in order, end() once."""
    _, model, ids = bundled
    rec = Recorder()
    out = ENTRY_POINTS[entry](model, ids, decoding_strategy="s2d2", block_size=16, max_new_tokens=32,
                              eos_token_id=None, streamer=rec, min_ssd_span_length=1, cache_ver=True,
                              draft_ver=True)
    assert rec.ended == 1
    assert rec.chunks[0] == ids[0].tolist()
    assert sum(rec.chunks[1:], []) == out[0, ids.shape[1]:].tolist()
    assert len(rec.chunks) - 1 > 2                     # 2 blocks of 16, streamed in more pieces than blocks


def test_direct_call_streams_prompt_and_end(bundled):
    _, model, ids = bundled
    rec = Recorder()
    out = hf_dllm_spec.dllm_generate(model, ids, decoding_strategy="block_diffusion", streamer=rec,
                                     generation_config=GenerationConfig(max_new_tokens=8))
    assert rec.chunks[0] == ids[0].tolist() and rec.ended == 1
    assert sum(rec.chunks[1:], []) == out[0, ids.shape[1]:].tolist()


def test_end_is_called_when_decoding_fails(bundled, monkeypatch):
    _, model, ids = bundled
    rec = Recorder()
    from hf_dllm_spec.strategies import BlockDiffusionStrategy

    def boom(self, block, logits):
        raise RuntimeError("boom")

    monkeypatch.setattr(BlockDiffusionStrategy, "denoise_step", boom)
    with pytest.raises(RuntimeError, match="boom"):
        model.generate(ids, decoding_strategy="block_diffusion", streamer=rec, max_new_tokens=8)
    assert rec.ended == 1


@pytest.mark.parametrize("strategy,kwargs", [
    ("ar", {}),
    ("block_diffusion", {"block_size": 4}),
    ("s2d2", {"block_size": 8}),
])
@pytest.mark.filterwarnings("ignore:`block_size`")
def test_stop_string_inside_a_block_cuts_output_and_stream(bundled, strategy, kwargs):
    """transformers' criteria look at the end of the sequence: every final prefix is tested, not block ends."""
    from transformers import StoppingCriteriaList, StopStringCriteria

    tokenizer, model, ids = bundled
    free = tokenizer.decode(model.generate(ids, decoding_strategy=strategy, max_new_tokens=40, eos_token_id=None,
                                           **kwargs)[0, ids.shape[1]:])
    assert "apples" in free                                       # the stop string occurs in the free text
    rec = Recorder()
    criteria = StoppingCriteriaList([StopStringCriteria(tokenizer, ["apples"])])
    out = model.generate(ids, decoding_strategy=strategy, max_new_tokens=40, eos_token_id=None,
                         stopping_criteria=criteria, streamer=rec, **kwargs)
    text = tokenizer.decode(out[0, ids.shape[1]:])
    assert text.endswith("apples") and free.startswith(text)
    assert sum(rec.chunks[1:], []) == out[0, ids.shape[1]:].tolist() and rec.ended == 1


@pytest.mark.parametrize("entry", list(ENTRY_POINTS))
@pytest.mark.parametrize("bad,name", [
    (dict(confidence_threshold=2.0), "confidence_threshold"),
    # checks of the raw call, before the callable's own `finally` (the consumer waited forever)
    (dict(num_beams=2), "num_beams"), (dict(stop_strings=["x"]), "tokenizer"),
    (dict(decoding_strategy="no-such-strategy"), "decoding_strategy")])
def test_end_is_called_when_a_check_fails(bundled, entry, bad, name):
    """transformers puts the prompt before the callable runs: a failing check must still end the stream."""
    _, model, ids = bundled
    rec = Recorder()
    with pytest.raises(ValueError, match=name):
        ENTRY_POINTS[entry](model, ids, streamer=rec, **{"decoding_strategy": "s2d2", **bad})
    assert rec.ended == 1
    rec = Recorder()
    with pytest.raises(ValueError, match=name):               # a direct call of the callable
        hf_dllm_spec.dllm_generate(model, ids, streamer=rec, **{"decoding_strategy": "s2d2", **bad})
    assert rec.ended == 1


class PromptRefuser(Recorder):
    def put(self, value):
        raise RuntimeError("the consumer is gone")


@pytest.mark.parametrize("entry", [*ENTRY_POINTS, "direct"])
@pytest.mark.parametrize("bad,error", [
    (dict(blok_size=4), "blok_size"),                                  # transformers: model_kwargs not used
    (dict(do_sample=True, temperature=-1.0), "temperature"),           # transformers' processor preparation
    (dict(streamer=PromptRefuser), "the consumer is gone"),            # the prompt's put, inside transformers
])
def test_end_is_called_once_when_transformers_preparation_fails(bundled, entry, bad, error):
    """transformers' own preparation of the call (after the library's checks of the raw call, before the callable
    runs) failed without ending the stream: a `TextIteratorStreamer` consumer waited forever. A failure of the
    callable inside transformers ends it once, not again on the way out."""
    _, model, ids = bundled
    bad = dict(bad)
    rec = bad.pop("streamer", Recorder)()
    call = ENTRY_POINTS.get(entry, lambda model, ids, **kw: hf_dllm_spec.dllm_generate(model, ids, **kw))
    with pytest.raises((ValueError, RuntimeError), match=error):
        call(model, ids, streamer=rec, decoding_strategy="s2d2", max_new_tokens=8, **bad)
    assert rec.ended == 1
    rec = Recorder()
    with pytest.raises(ValueError, match="confidence_threshold"):           # refused inside the callable
        call(model, ids, streamer=rec, decoding_strategy="s2d2", max_new_tokens=8, confidence_threshold=2.0)
    assert rec.ended == 1


def test_a_streamer_reused_for_a_second_call_is_ended_again(bundled):
    """The record of ended streamers belongs to one call: the same streamer passed to the next call is ended by it
    too (a kept record would leave that consumer waiting)."""
    _, model, ids = bundled
    rec = Recorder()
    for calls in (1, 2):
        model.generate(ids, decoding_strategy="block_diffusion", streamer=rec, max_new_tokens=4)
        assert rec.ended == calls


def test_end_is_called_once_when_a_criterion_interrupts_the_call(bundled):
    """A `BaseException` that is not an `Exception` (KeyboardInterrupt, a criterion's own) still ends the stream,
    once."""
    from transformers import StoppingCriteria, StoppingCriteriaList

    class Interrupt(BaseException):
        pass

    class Interrupting(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            raise Interrupt()

    _, model, ids = bundled
    rec = Recorder()
    with pytest.raises(Interrupt):
        model.generate(ids, decoding_strategy="block_diffusion", streamer=rec, max_new_tokens=8,
                       stopping_criteria=StoppingCriteriaList([Interrupting()]))
    assert rec.ended == 1


@pytest.mark.parametrize("entry", ["model_class", "hub_folder"])
def test_stop_strings_with_tokenizer(bundled, entry):
    tokenizer, model, ids = bundled
    out = ENTRY_POINTS[entry](model, ids, decoding_strategy="block_diffusion", block_size=4, max_new_tokens=40,
                              eos_token_id=None, stop_strings=["apples"], tokenizer=tokenizer)
    assert tokenizer.decode(out[0, ids.shape[1]:]).endswith("apples")
    with pytest.raises(ValueError, match=r"`stop_strings` .* must come with `tokenizer`"):
        ENTRY_POINTS[entry](model, ids, decoding_strategy="block_diffusion", stop_strings=["apples"])


@pytest.mark.parametrize("entry", ["model_class", "hub_folder"])
def test_stop_strings_of_the_generation_config(bundled, entry):
    """Stop strings in a passed `GenerationConfig` stop as the keyword does (transformers refused them: no tokenizer
    reached its criteria); in the model's own generation config, where transformers cannot be kept from reading
    them, they are refused with the fix (it said no tokenizer was passed, though one was)."""
    from transformers import GenerationConfig

    tokenizer, model, ids = bundled
    common = dict(decoding_strategy="block_diffusion", block_size=4, max_new_tokens=40, eos_token_id=None)
    want = ENTRY_POINTS[entry](model, ids, stop_strings=["apples"], tokenizer=tokenizer, **common)
    assert tokenizer.decode(want[0, ids.shape[1]:]).endswith("apples")
    passed = GenerationConfig(stop_strings=["apples"], max_new_tokens=40, eos_token_id=None)
    assert torch.equal(ENTRY_POINTS[entry](model, ids, generation_config=passed, tokenizer=tokenizer,
                                           decoding_strategy="block_diffusion", block_size=4), want)
    assert passed.stop_strings == ["apples"]
    with pytest.raises(ValueError, match=r"`stop_strings` .* must come with `tokenizer`"):
        ENTRY_POINTS[entry](model, ids, generation_config=passed, decoding_strategy="block_diffusion")
    model.generation_config.stop_strings = ["apples"]
    try:
        with pytest.raises(ValueError, match=r"`generation_config.stop_strings` .*set `model\.generation_config"):
            ENTRY_POINTS[entry](model, ids, tokenizer=tokenizer, **common)
    finally:
        model.generation_config.stop_strings = None


def test_direct_call_prepares_options_like_generate(bundled):
    """A direct call goes through transformers' preparation: options are applied or refused, never dropped."""
    _, model, ids = bundled
    kwargs = dict(decoding_strategy="s2d2", max_new_tokens=16, do_sample=True, min_p=0.3)
    direct = hf_dllm_spec.dllm_generate(model, ids, generator=torch.Generator().manual_seed(3), **kwargs)
    via_generate = model.generate(ids, generator=torch.Generator().manual_seed(3), **kwargs)
    assert torch.equal(direct, via_generate)
    with pytest.raises(NotImplementedError, match="RepetitionPenaltyLogitsProcessor"):
        hf_dllm_spec.dllm_generate(model, ids, decoding_strategy="s2d2", repetition_penalty=1.3)
    with pytest.raises(ValueError, match="max_new_token"):
        hf_dllm_spec.dllm_generate(model, ids, decoding_strategy="s2d2", max_new_token=4)
