"""DEER's cycle as compiled functions (issue 34, phase 3): under `cache_implementation="static"` with a
`compile_config`, greedy DEER (greedy_match acceptance) runs the target's prefill as one compiled step and each cycle
as one compiled drafter step (the drafter stores the new committed tokens, or the prompts, at a fixed width and
proposes the block) and one compiled verify step (the target forward storing `[x_j | drafts]`, greedy_match with the
recovered or bonus token, the discard of the rejected drafts, the new carry, the next cycle's inputs), with one host
read per cycle.

Checked on the CPU with the bundled pair (target qwen2-tiny-ar, drafter deer-drafter-tiny): the eager runtime's
tokens and per-row counters for batch 1 and a left-padded batch of 2 whose rows stop at different cycles and verify
fewer drafts near their budget, fullgraph (a graph break raises), one graph per key over 64-token calls (the first
call's prefill and first cycle eager: a compiled step never allocates a cache), at most one host read per cycle,
and the cases the compiled cycle does not serve on the eager cycle. Dynamo's "eager" backend (the trace and its
guards); one slow test runs inductor.
"""

from __future__ import annotations

import shutil

import pytest
import torch
from conftest import assert_same_decode, cpu_compile_config

import hf_dllm_spec
from hf_dllm_spec.runtime.static import clear_static_state, static_states
from hf_dllm_spec.strategies import deer
from hf_dllm_spec.tools.jobs.evaluation import ROOT, arithmetic_prompts, load

AR_DIR = ROOT / "models" / "qwen2-tiny-ar"
DRAFTER_DIR = ROOT / "models" / "deer-drafter-tiny"


@pytest.fixture(scope="module")
def pair():
    """The bundled pair and two prompts; their static state cleared first and after (the tests of this module count
    their own graphs: conftest.cpu_compile_config), and sized once by an uncompiled static call of both prompts and
    64 tokens: every test then runs on caches of the same rows and columns, so they share their compiled steps
    (compiling dominates the time)."""
    tokenizer, target = load(AR_DIR)
    _, drafter = load(DRAFTER_DIR)
    tokenizer.padding_side = "left"
    pair = tokenizer, target, drafter, [p.text for p in arithmetic_prompts(AR_DIR, 2)]
    clear(pair)
    enc = tokenizer(pair[3], return_tensors="pt", padding=True)
    target.generate(enc.input_ids, attention_mask=enc.attention_mask, custom_generate=hf_dllm_spec.custom_generate,
                    decoding_strategy="deer", draft_model=drafter, block_size=4, max_new_tokens=64, eos_token_id=None,
                    cache_implementation="static")
    yield pair
    clear(pair)


pytestmark = pytest.mark.usefixtures("as_users_run_it")


def generate(pair, prompts, compiled: bool | str, **kwargs):
    """`compiled`: False (the eager runtime), True (dynamo's "eager" backend) or a backend's name."""
    tokenizer, target, drafter, _ = pair
    enc = tokenizer(prompts, return_tensors="pt", padding=True)
    backend = compiled if isinstance(compiled, str) else "eager"
    static = dict(cache_implementation="static", compile_config=cpu_compile_config(backend)) if compiled else {}
    return target.generate(enc.input_ids, attention_mask=enc.attention_mask, return_dict_in_generate=True,
                           custom_generate=hf_dllm_spec.custom_generate, decoding_strategy="deer", draft_model=drafter,
                           **{"block_size": 4, "max_new_tokens": 16, **static, **kwargs})


def deer_keys(pair) -> list[tuple]:
    return [key for model in pair[1:3] for state in static_states(model) for key in state.steps.keys
            if key[0].startswith("deer-")]


def one_graph_each(pair) -> bool:
    return all(state.steps.graphs(key) == 1 for model in pair[1:3] for state in static_states(model)
               for key in state.steps.keys)


def clear(pair) -> None:
    for model in pair[1:3]:
        clear_static_state(model)      # count its own graphs only (conftest.cpu_compile_config)


def test_one_graph_per_key_over_a_64_token_call(pair):
    """A 64-token call: each key (prefill, drafter and verify steps, per width and attended prefix) compiled once,
    fullgraph; a second call of new strategy and runner objects reuses them all and counts the same forwards."""
    params = dict(max_new_tokens=64, eos_token_id=None)
    first = generate(pair, pair[3][:1], True, **params)
    keys = deer_keys(pair)
    assert {key[0] for key in keys} == {"deer-prefill", "deer-draft", "deer-verify"} and one_graph_each(pair)
    second = generate(pair, pair[3][:1], True, **params)
    assert deer_keys(pair) == keys and one_graph_each(pair)
    assert second.sequences.tolist() == first.sequences.tolist()
    stats = first.spec_stats
    assert stats.num_forward_calls == 1 + stats.num_draft_forwards + stats.num_verify_forwards


def test_batch_of_one_equals_the_eager_runtime(pair):
    """Batch 1, a row that ends one token short of its budget: its last cycle runs no drafter forward and takes one
    plain AR step (a fallback token) in the compiled verify step, with every draft masked."""
    prompts = pair[3][:1]
    eager = generate(pair, prompts, False, max_new_tokens=12, eos_token_id=None)
    compiled = generate(pair, prompts, True, max_new_tokens=12, eos_token_id=None)
    assert_same_decode(eager, compiled)
    assert compiled.spec_stats.num_fallback_tokens == 1
    assert {key[0] for key in deer_keys(pair)} == {"deer-prefill", "deer-draft", "deer-verify"}


def test_left_padded_batch_equals_the_eager_runtime(pair):
    """A left-padded batch of 2 whose second row stops early (a stop id it generates), so the cycles run at 2 and
    then 1 rows; near its budget the first row verifies fewer drafts: tokens and every per-row counter (forwards by
    kind, drafts, accepted, recovered, bonus, fallback and committed tokens, per-position acceptance) equal the
    eager runtime's; one graph per key."""
    prompts = pair[3]
    eager = generate(pair, prompts, False)
    prompt_width = eager.sequences.shape[1] - 16
    stop = eager.sequences[1, prompt_width + 5].item()
    eager = generate(pair, prompts, False, eos_token_id=stop, max_new_tokens=14)
    lengths = [row.num_committed_tokens for row in eager.spec_stats_per_row]
    assert min(lengths) < max(lengths)                                    # rows finish at different cycles
    compiled = generate(pair, prompts, True, eos_token_id=stop, max_new_tokens=14)
    assert_same_decode(eager, compiled)
    rows = compiled.spec_stats_per_row
    assert any(row.num_drafts_reaching_pos[-1] < row.num_drafts for row in rows)      # fewer drafts near a budget
    assert sum(row.num_bonus_tokens for row in rows) > 0 and sum(row.num_recovered_tokens for row in rows) > 0
    assert one_graph_each(pair)


def test_a_one_token_prompt_equals_the_eager_runtime(pair):
    """A batch of 2 whose second prompt is one token: that row stores nothing in the compiled prefill (its carry
    stays zero) and its first draft reads the one token."""
    tokenizer, target, drafter, prompts = pair
    first = tokenizer(prompts[0], return_tensors="pt").input_ids[0]
    ids, mask = torch.zeros(2, first.shape[0], dtype=torch.long), torch.zeros(2, first.shape[0], dtype=torch.long)
    ids[0], mask[0], ids[1, -1], mask[1, -1] = first, 1, first[0], 1

    def call(compiled: bool):
        static = dict(cache_implementation="static", compile_config=cpu_compile_config()) if compiled else {}
        return target.generate(ids, attention_mask=mask, return_dict_in_generate=True,
                               custom_generate=hf_dllm_spec.custom_generate, decoding_strategy="deer",
                               draft_model=drafter, block_size=4, max_new_tokens=16, eos_token_id=None, **static)

    assert_same_decode(call(False), call(True))


def test_at_most_one_host_read_per_cycle(pair, step_syncs):
    """Batch 1: between the first and the last compiled call the loop reads the device at most once per cycle of
    two forwards (the verify step's read; the prefill step reads nothing). Inside the compiled steps nothing reads
    it (fullgraph), and the counter is paused there."""
    params = dict(max_new_tokens=32, eos_token_id=None)
    generate(pair, pair[3][:1], True, **params)
    with step_syncs.counting() as syncs:
        generate(pair, pair[3][:1], True, **params)
    assert len(step_syncs.before) > 4
    assert step_syncs.per_step() <= 0.5, syncs.by_site.most_common(4)


def test_a_graph_break_in_the_step_raises(pair, monkeypatch):
    """fullgraph=True: a graph break in the verify step's maths (here in greedy_match) raises instead of running
    slowly (k = 2: keys of its own, traced anew; the later tests count no graphs)."""
    match = deer.greedy_match

    def breaking(*args, **kwargs):
        torch._dynamo.graph_break()
        return match(*args, **kwargs)

    monkeypatch.setattr(deer, "greedy_match", breaking)
    with pytest.raises(torch._dynamo.exc.Unsupported):
        generate(pair, pair[3][:1], True, max_new_tokens=12, block_size=2)


@pytest.mark.parametrize("params", [dict(do_sample=True, top_k=5), dict(draft_attention="full")])
def test_other_cases_run_the_eager_cycle(pair, params, monkeypatch):
    """Sampling (rejection sampling), the "full" drafter layout: today's eager prefill and cycle."""
    for name in ("deer_prefill_step", "deer_draft_step", "deer_verify_step"):
        monkeypatch.setattr(deer, name, None)                            # would fail if called
    generate(pair, pair[3][:1], True, max_new_tokens=2, generator=torch.Generator().manual_seed(0), **params)


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("cc") is None,
                    reason="torch.compile (inductor) needs a C++ compiler on the CPU")
def test_inductor_compiled_steps_give_the_eager_tokens(pair):
    """Inductor (transformers' default backend), a left-padded batch of 2, twice: the eager runtime's tokens and
    counters, from fresh caches (the first call's prefill and first cycle eager: a compiled step never allocates a
    cache) and then from the caches it left (every step compiled)."""
    clear(pair)
    eager = generate(pair, pair[3], False)
    assert_same_decode(eager, generate(pair, pair[3], "inductor"))
    assert {key[0] for key in deer_keys(pair)} == {"deer-draft", "deer-verify"}
    assert_same_decode(eager, generate(pair, pair[3], "inductor"))
    assert {key[0] for key in deer_keys(pair)} == {"deer-prefill", "deer-draft", "deer-verify"}
    clear(pair)
