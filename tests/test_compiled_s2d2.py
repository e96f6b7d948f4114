"""S2D2's denoising step as compiled functions (issue 34, phase 2): under `cache_implementation="static"` with a
`compile_config`, greedy S2D2 (greedy_match acceptance) on a position-aligned model runs each step as one compiled
draft step (draft forward, routing numbers, the rule's commits as if no row verified) and, when a policy verifies,
one compiled verify step (verifier forward, greedy_match, the verifying rows' commits), each with one host read.

Checked on the CPU with the bundled sdar-tiny-arith: the eager runtime's tokens and per-row counters for every
routing policy and with sub-blocks (batch 1 and a left-padded batch of 2 whose rows stop at different steps),
fullgraph (a graph break raises), one graph per key over a 64-token call and a second call, at most one host read
per forward, and the cases the compiled step does not serve on the eager step. Seeded (phase 4): sampled drafts,
stochastic and greedy_match acceptance, shared and per-row generators (the generators end where the eager ones end),
on SDAR, Fast-dLLM v2 and LLaDA2.1. Dynamo's "eager" backend (the trace and its guards); one slow test runs inductor.
The bundled models run with their first two layers (`conftest.load_first_layers`: compiling costs about layers in
proportion).
"""

from __future__ import annotations

import shutil

import pytest
import torch
from conftest import (Recorder, assert_same_decode, cpu_compile_config, fast_first, generator_states,
                      load_first_layers, seeded, stream_on_the_host)

from hf_dllm_spec.runtime.static import clear_static_state, static_states
from hf_dllm_spec.strategies import s2d2

PROMPTS = ["12+7=", "3*4+25="]
#: The main job's S2D2 row (benchmarks/host_work.py): AR-like caching and drafting masks, threshold 0.9.
MAIN_JOB = dict(min_ssd_span_length=1, cache_ver=True, draft_ver=True, confidence_threshold=0.9)
POLICIES = {
    "span-1": MAIN_JOB,
    "span-2": dict(min_ssd_span_length=2),             # rows verify at some steps and fall back at others
    "score": dict(do_verify_policy="score_threshold", do_verify_score_threshold=0.5,
                  token_acceptance_estimator="soft_entropy_negexp"),
    "hysteresis": dict(do_verify_policy="score_hysteresis", hysteresis_threshold_on=1.0,
                       hysteresis_threshold_off=0.5),
    "ucb": dict(do_verify_policy="contextual_bandit_ucb"),
    "sub-blocks": dict(sub_block_size=2),              # C_t and the fallback end with the current sub-block
}


@pytest.fixture(scope="module")
def arith():
    return load_first_layers("sdar-tiny-arith")


pytestmark = pytest.mark.usefixtures("as_users_run_it")


def generate(arith, prompts, compiled: bool | str, **kwargs):
    """`compiled`: False (the eager runtime), True (dynamo's "eager" backend) or a backend's name."""
    tokenizer, model = arith
    enc = tokenizer(prompts, return_tensors="pt", padding=True)
    backend = compiled if isinstance(compiled, str) else "eager"
    static = dict(cache_implementation="static", compile_config=cpu_compile_config(backend)) if compiled else {}
    return model.generate(enc.input_ids, attention_mask=enc.attention_mask, return_dict_in_generate=True,
                          **{"decoding_strategy": "s2d2", "max_new_tokens": 16, **static, **kwargs})


def s2d2_keys(model) -> list[tuple]:
    return [key for state in static_states(model) for key in state.steps.keys if key[0] in ("draft", "verify")]


def one_graph_each(model) -> bool:
    return all(state.steps.graphs(key) == 1 for state in static_states(model) for key in state.steps.keys)


@pytest.mark.parametrize("policy", fast_first(list(POLICIES)))
def test_tokens_and_counters_equal_the_eager_runtime(arith, policy):
    """A left-padded batch of 2 whose second row stops early (a stop id it generates), so the steps run at 2 and
    then 1 rows: tokens and every per-row counter (forwards by kind, drafts, accepted, recovered, fallback tokens,
    per-position acceptance) equal the eager runtime's; both compiled steps ran."""
    clear_static_state(arith[1])      # count its own graphs only (conftest.cpu_compile_config)
    params = POLICIES[policy]
    eager = generate(arith, PROMPTS, False, **params)
    prompt_width = eager.sequences.shape[1] - 16
    stop = eager.sequences[1, prompt_width + 5].item()
    eager = generate(arith, PROMPTS, False, eos_token_id=stop, **params)
    compiled = generate(arith, PROMPTS, True, eos_token_id=stop, **params)
    assert_same_decode(eager, compiled)
    assert compiled.spec_stats.num_verify_forwards > 0
    keys = s2d2_keys(arith[1])
    assert {key[0] for key in keys} == {"draft", "verify"}
    assert one_graph_each(arith[1])
    if policy == "span-2":
        assert compiled.spec_stats.num_fallback_tokens > 0


@pytest.fixture(scope="module")
def fast():
    return load_first_layers("fast-dllm-v2-tiny")


@pytest.mark.parametrize("params", fast_first([{}, dict(fuse_cache_write=True, block_size=8,
                                                       min_ssd_span_length=2)]))
def test_right_shifted_model_equals_the_eager_runtime(fast, params):
    """S2D2 on Fast-dLLM v2 (right-shifted): the draft and verify steps take the carry (the verifier reads `x~`
    under a causal mask), the family's separate cache writes are compiled calls, or fused writes store the last
    block in the next draft step and return the new carry. A left-padded batch of 2 and batch 1: the eager
    runtime's tokens and per-row counters; both steps ran."""
    clear_static_state(fast[1])
    for prompts in (PROMPTS, PROMPTS[1:]):
        eager = generate(fast, prompts, False, max_new_tokens=24, **params)
        compiled = generate(fast, prompts, True, max_new_tokens=24, **params)
        assert_same_decode(eager, compiled)
        assert compiled.spec_stats.num_verify_forwards > 0
    assert {key[0] for key in s2d2_keys(fast[1])} == {"draft", "verify"}
    assert one_graph_each(fast[1])


@pytest.fixture(scope="module")
def llada2():
    return load_first_layers("llada2-tiny")


@pytest.mark.slow
def test_token_editing_equals_the_eager_runtime(llada2, llada2_model):
    """S2D2 on LLaDA2.1 (token editing, `num_to_transfer`, editing-only post steps): the draft step applies the
    edits before C_t and the routing numbers, the verifier reads the edited block, a block ends by the edit rule's
    post steps. The bundled llada2-tiny with the paper's preset, and a tiny random LLaDA2 with a low editing
    threshold (so that tokens are edited); a left-padded batch of 2 (and batch 1 on the random model): the eager
    runtime's tokens and per-row counters (edits included)."""
    tokenizer, model = llada2
    ids, mask = left_padded([[5, 17, 42, 8, 9], [7, 3]])
    cases = [(llada2, dict(preset="llada2.1-mini-quality")),
             ((None, llada2_model), dict(block_size=4, confidence_threshold=0.3, editing_threshold=0.05,
                                         max_post_steps=2, num_to_transfer=1, min_ssd_span_length=2))]
    for (tokenizer, model), params in cases:
        clear_static_state(model)
        edited = 0
        for rows in (slice(None),) if tokenizer is not None else (slice(None), slice(1, None)):
            if tokenizer is not None:
                enc = tokenizer(PROMPTS[rows], return_tensors="pt", padding=True)
                inputs = dict(input_ids=enc.input_ids, attention_mask=enc.attention_mask)
            else:
                inputs = dict(input_ids=ids[rows], attention_mask=mask[rows], pad_token_id=0, eos_token_id=None)
            common = dict(decoding_strategy="s2d2", max_new_tokens=16, return_dict_in_generate=True, **params)
            eager = model.generate(**inputs, **common)
            compiled = model.generate(**inputs, cache_implementation="static", compile_config=cpu_compile_config(),
                                      **common)
            assert_same_decode(eager, compiled)
            edited += eager.spec_stats.num_edited_tokens
        assert edited > 0 or tokenizer is not None
        assert "draft" in {key[0] for key in s2d2_keys(model)} and one_graph_each(model)


def left_padded(prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, prompts))
    return (torch.tensor([[0] * (width - len(p)) + p for p in prompts]),
            torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts]))


@pytest.mark.slow
def test_batch_of_one_equals_the_eager_runtime(arith):
    assert_same_decode(generate(arith, PROMPTS[1:], False, **MAIN_JOB), generate(arith, PROMPTS[1:], True, **MAIN_JOB))


@pytest.mark.slow
def test_one_graph_per_key_and_one_host_read_per_forward_over_a_64_token_call(arith, step_syncs):
    """A 64-token call: each key (draft with and without a pending block, verify; per attended prefix) compiled
    once, fullgraph; a second call of new strategy and runner objects reuses them all, and between its first and
    last compiled call the loop reads the device at most once per forward (the draft step's read, and the verify
    step's when a row verifies). Inside the compiled steps nothing reads it (fullgraph), and the counter is paused
    there (dynamo would trace into it)."""
    clear_static_state(arith[1])
    first = generate(arith, PROMPTS[:1], True, max_new_tokens=64, eos_token_id=None, **MAIN_JOB)
    keys = s2d2_keys(arith[1])
    assert {key[0] for key in keys} == {"draft", "verify"} and one_graph_each(arith[1])
    with step_syncs.counting() as syncs:
        second = generate(arith, PROMPTS[:1], True, max_new_tokens=64, eos_token_id=None, **MAIN_JOB)
    assert s2d2_keys(arith[1]) == keys and one_graph_each(arith[1])
    assert second.sequences.tolist() == first.sequences.tolist()
    stats = first.spec_stats
    assert stats.num_forward_calls == 1 + stats.num_draft_forwards + stats.num_verify_forwards
    assert stats.num_verify_forwards > 0 and len(step_syncs.before) > 4
    assert step_syncs.per_step() <= 1.0, syncs.by_site.most_common(4)


def test_a_graph_break_in_the_step_raises(arith, monkeypatch):
    """fullgraph=True: a graph break in the S2D2 step's maths (here in C_t) raises instead of running slowly."""
    span = s2d2.first_masked_span

    def breaking(masked):
        torch._dynamo.graph_break()
        return span(masked)

    monkeypatch.setattr(s2d2, "first_masked_span", breaking)
    clear_static_state(arith[1])
    with pytest.raises(torch._dynamo.exc.Unsupported):
        generate(arith, PROMPTS[:1], True, max_new_tokens=4)
    clear_static_state(arith[1])


@pytest.mark.parametrize("params", fast_first([dict(do_sample=True, sequence_bias={(5,): 1.0}),
                                               dict(remasking_strategy="sequential")]))
def test_other_cases_run_the_eager_step(arith, params, monkeypatch):
    """Sampling with a processor outside transformers' position-independent warpers, a fallback rule other than the
    confidence ones: today's eager S2D2 step."""
    monkeypatch.setattr(s2d2, "s2d2_draft_step", None)                      # would fail if called
    clear_static_state(arith[1])
    generate(arith, PROMPTS[:1], True, max_new_tokens=8, generator=torch.Generator().manual_seed(0), **params)
    assert s2d2_keys(arith[1]) == []


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("cc") is None,
                    reason="torch.compile (inductor) needs a C++ compiler on the CPU")
def test_inductor_compiled_steps_give_the_eager_tokens(arith):
    """Inductor (transformers' default backend), the main job's S2D2 row, one prompt, two blocks (few keys: the
    inductor compilation is the cost; batches and padding are checked with dynamo's "eager" backend above): the
    eager runtime's tokens and counters."""
    clear_static_state(arith[1])
    params = dict(MAIN_JOB, max_new_tokens=8)
    eager = generate(arith, PROMPTS[:1], False, **params)
    assert_same_decode(eager, generate(arith, PROMPTS[:1], "inductor", **params))
    assert {key[0] for key in s2d2_keys(arith[1])} == {"draft", "verify"}
    clear_static_state(arith[1])


# -- seeded (issue 34, phase 4): sampled drafts, stochastic acceptance --------------------------------------------
SAMPLED = dict(do_sample=True, temperature=1.5, top_k=20)
SEEDED = {
    "stochastic-shared": dict(SAMPLED, s2d2_acceptance="stochastic", generator="shared"),
    "stochastic-rows": dict(SAMPLED, s2d2_acceptance="stochastic", generator="rows", min_ssd_span_length=2),
    "greedy-match-rows": dict(SAMPLED, s2d2_acceptance="greedy_match", generator="rows"),
    "no-resample-shared": dict(SAMPLED, allow_resample=False, generator="shared", **MAIN_JOB),
    "stochastic-greedy-drafts": dict(s2d2_acceptance="stochastic", generator="rows"),
}


def assert_same_seeded_decode(model_and_tokenizer, prompts, params: dict, **kwargs):
    """The eager runtime and the compiled steps, each with its own generators seeded alike: the same tokens, per-row
    counters and forwards, and the generators left in the same states (the steps drew what the eager step drew)."""
    eager_params, compiled_params = seeded(params, len(prompts)), seeded(params, len(prompts))
    eager = generate(model_and_tokenizer, prompts, False, **eager_params, **kwargs)
    compiled = generate(model_and_tokenizer, prompts, True, **compiled_params, **kwargs)
    assert_same_decode(eager, compiled)
    assert generator_states(eager_params.get("generator")) == generator_states(compiled_params.get("generator"))
    return eager, compiled


@pytest.mark.parametrize("case", fast_first(list(SEEDED)))
def test_seeded_steps_equal_the_eager_runtime(arith, case):
    """Seeded S2D2 compiled: the draft step draws its tokens with the noise drawn before it (block diffusion's
    `step_noise`), the verify step rejection-samples with the uniforms and recovered-token noise that the eager
    verification draws for the verifying rows, drawn on the host between the two calls (`verify_draws`). A
    left-padded batch of 2 whose second row stops early and batch 1, one generator for the batch and one per row,
    stochastic and greedy_match acceptance over sampled drafts, `allow_resample=False`, stochastic acceptance of
    greedy drafts: the eager runtime's tokens, per-row counters and generator states; drafts are rejected."""
    clear_static_state(arith[1])
    params = SEEDED[case]
    eager = generate(arith, PROMPTS, False, **seeded(params, 2))
    stop = eager.sequences[1, eager.sequences.shape[1] - 16 + 5].item()
    eager, compiled = assert_same_seeded_decode(arith, PROMPTS, params, eos_token_id=stop)
    assert compiled.spec_stats.num_verify_forwards > 0
    stats = eager.spec_stats
    if params.get("s2d2_acceptance") != "greedy_match":       # the rejection test ran and rejected
        assert stats.num_draft_tokens > stats.num_accepted_tokens
    if case == next(iter(SEEDED)):                   # batch 1 too (the other cases: a batch whose row stops)
        assert_same_seeded_decode(arith, PROMPTS[1:], params)
    assert {key[0] for key in s2d2_keys(arith[1])} == {"draft", "verify"}
    assert one_graph_each(arith[1])


@pytest.mark.slow
@pytest.mark.parametrize("family", ["fast", "llada2"])
def test_seeded_steps_on_other_families(fast, llada2, family):
    """Seeded S2D2 on Fast-dLLM v2 (right-shifted; the sampled carry commits of the separate writes stay eager) and on
    the bundled LLaDA2.1 with the paper's preset (token editing; verifying at every step): per-row generators on a
    left-padded batch of 2, a shared one on batch 1: the eager runtime's tokens, counters and generator states."""
    model_and_tokenizer = fast if family == "fast" else llada2
    extra = (dict(max_new_tokens=24) if family == "fast"
             else dict(preset="llada2.1-mini-quality", do_verify_policy="mask_span_length"))
    clear_static_state(model_and_tokenizer[1])
    for kind, prompts in (("rows", PROMPTS), ("shared", PROMPTS[1:])):
        params = dict(SAMPLED, s2d2_acceptance="stochastic", generator=kind, **extra)
        eager, _ = assert_same_seeded_decode(model_and_tokenizer, prompts, params)
        assert eager.spec_stats.num_verify_forwards > 0
    assert "draft" in {key[0] for key in s2d2_keys(model_and_tokenizer[1])}
    assert one_graph_each(model_and_tokenizer[1])


@pytest.mark.slow
def test_seeded_one_graph_per_key_and_one_host_read_per_forward(arith, step_syncs, monkeypatch):
    """Seeded (per-row generators, stochastic acceptance), a 64-token call at batch 1: each key compiled once; a
    second call with generators seeded alike reuses them all, gives the same tokens and reads the device at most
    once per compiled forward. The draws read nothing from the device: the verifying rows and their span lengths
    come from the draft step's read (with per-row generators `draw_verification` lists the lengths of a host
    tensor, checked here and left out of the count, which sees every `tolist`)."""
    draw = s2d2.draw_verification

    def on_the_host(lengths, *args, **kwargs):
        assert lengths.device.type == "cpu"
        with step_syncs.paused():
            return draw(lengths, *args, **kwargs)

    monkeypatch.setattr(s2d2, "draw_verification", on_the_host)
    clear_static_state(arith[1])
    params = dict(SEEDED["stochastic-rows"], max_new_tokens=64, eos_token_id=None)
    first = generate(arith, PROMPTS[:1], True, **seeded(params, 1))
    keys = s2d2_keys(arith[1])
    assert {key[0] for key in keys} == {"draft", "verify"} and one_graph_each(arith[1])
    with step_syncs.counting() as syncs:
        second = generate(arith, PROMPTS[:1], True, **seeded(params, 1))
    assert s2d2_keys(arith[1]) == keys and one_graph_each(arith[1])
    assert second.sequences.tolist() == first.sequences.tolist()
    assert second.spec_stats.num_verify_forwards > 0 and len(step_syncs.before) > 4
    assert step_syncs.per_step() <= 1.0, syncs.by_site.most_common(4)


# -- streaming (issue 34, phase 4) ----------------------------------------------------------------------------------
STREAMED = {
    "span-2": dict(POLICIES["span-2"]),
    "main-job-no-drafts": dict(MAIN_JOB, drafts=False),
    "seeded-stochastic": dict(SEEDED["stochastic-rows"]),
}


@pytest.mark.parametrize("case", list(STREAMED))
@pytest.mark.slow
def test_streaming_equals_the_eager_runtime(arith, case):
    """Batch 1 with a streamer, compiled S2D2: the streamer receives exactly the eager runtime's `put` / `put_draft` /
    `end` calls (the draft canvas from the draft step's read, the final prefix after the step's last read, the
    verify step's when a row verified); tokens and counters equal too."""
    clear_static_state(arith[1])
    params = dict(STREAMED[case])
    drafts = params.pop("drafts", True)
    eager_streamer, compiled_streamer = Recorder(drafts), Recorder(drafts)
    eager = generate(arith, PROMPTS[1:], False, streamer=eager_streamer, **seeded(params, 1))
    compiled = generate(arith, PROMPTS[1:], True, streamer=compiled_streamer, **seeded(params, 1))
    assert_same_decode(eager, compiled)
    assert compiled_streamer.events == eager_streamer.events
    kinds = [event[0] for event in eager_streamer.events]
    assert kinds[-1] == "end" and kinds.count("put") > 2 and ("draft" in kinds) == drafts
    assert compiled.spec_stats.num_verify_forwards > 0
    assert {key[0] for key in s2d2_keys(arith[1])} == {"draft", "verify"} and one_graph_each(arith[1])


@pytest.mark.slow
def test_streaming_at_most_one_host_read_per_forward(arith, step_syncs, monkeypatch):
    """Batch 1 with a streamer taking drafts: at most one host read per compiled forward; the stream gets host
    tensors built from the reads (:func:`conftest.stream_on_the_host`)."""
    stream_on_the_host(monkeypatch, step_syncs)
    clear_static_state(arith[1])
    params = dict(max_new_tokens=24, eos_token_id=None, **POLICIES["span-2"])
    generate(arith, PROMPTS[:1], True, streamer=Recorder(), **params)
    with step_syncs.counting() as syncs:
        out = generate(arith, PROMPTS[:1], True, streamer=Recorder(), **params)
    assert out.spec_stats.num_verify_forwards > 0 and len(step_syncs.before) > 4
    assert step_syncs.per_step() <= 1.0, syncs.by_site.most_common(6)
    assert one_graph_each(arith[1])
