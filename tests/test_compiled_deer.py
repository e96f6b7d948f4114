"""DEER's cycle as compiled functions (issue 34, phases 3-4): under `cache_implementation="static"` with a
`compile_config`, DEER (greedy: greedy_match; seeded: rejection sampling, its random numbers and the drafter's drawn
before each step from the call's generators) runs the target's prefill as one compiled step and each cycle
as one compiled drafter step (the drafter stores the new committed tokens, or the prompts, at a fixed width and
proposes the block) and one compiled verify step (the target forward storing `[x_j | drafts]`, the acceptance rule
with the recovered or bonus token, the discard of the rejected drafts, the new carry, the next cycle's inputs), with
one host read per cycle; a streamer gets the committed tokens and the drafts from that read.

Checked on the CPU with the bundled pair (target qwen2-tiny-ar, drafter deer-drafter-tiny): the eager runtime's
tokens and per-row counters for batch 1 and a left-padded batch of 2 whose rows stop at different cycles and verify
fewer drafts near their budget, fullgraph (a graph break raises), one graph per key over 64-token calls (the first
call's prefill and first cycle eager: a compiled step never allocates a cache), at most one host read per cycle,
rows that join (continuous batching: every cycle compiled, the one after the join too), the "full" drafter layout
(its context at width buckets), one-token prompts (their first cycle eager: no carry yet); seeded (a shared
generator and one per row): the eager runtime's tokens and counters; a streamer: the eager runtime's `put` /
`put_draft` calls. Dynamo's "eager" backend (the trace and its guards); one slow test runs inductor.
"""

from __future__ import annotations

import inspect
import shutil
from collections import Counter

import pytest
import torch
from conftest import (Recorder, ScriptedFeed, assert_same_decode, cpu_compile_config, fast_first, generator_states,
                      spec_counters)

import hf_dllm_spec
from hf_dllm_spec.integration.rows import RowRequest
from hf_dllm_spec.runtime.static import clear_static_state, static_states
from hf_dllm_spec.strategies import deer
from hf_dllm_spec.strategies.base import DecodingStrategy
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


@pytest.mark.slow
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


#: Sampling settings of the seeded tests (they run before the graph-break test, which leaves a key without a graph):
#: drafts that the target sometimes rejects (recovered tokens) and sometimes accepts whole (bonus tokens).
SEEDED = dict(do_sample=True, top_k=20, temperature=2.5)


def generators(kind: str, rows: int = 2, seed: int = 7):
    """A fresh shared generator, or one per row (`generator=[g0, g1]`), seeded the same for every call."""
    if kind == "shared":
        return torch.Generator().manual_seed(seed)
    return [torch.Generator().manual_seed(seed + i) for i in range(rows)]


def seeded_keys(pair) -> set[str]:
    """The DEER cycle's step keys compiled for rejection sampling (their key holds the acceptance rule; the prefill's
    does not depend on it)."""
    return {key[0] for key in deer_keys(pair) if "rejection_sampling" in key}


@pytest.mark.parametrize("kind", fast_first(["shared", "per-row"]))
def test_seeded_left_padded_batch_equals_the_eager_runtime(pair, kind):
    """Seeded rejection sampling, a shared generator or one per row: a left-padded batch of 2 whose second row stops
    early (a stop id it draws), fewer drafts near the first row's budget: the eager runtime's tokens and every
    per-row counter, recovered and bonus tokens among them, from the compiled steps (the drafter's noise and the
    verification's uniforms and noise drawn before them); one graph per key."""
    prompts = pair[3]
    eager = generate(pair, prompts, False, generator=generators(kind), **SEEDED)
    prompt_width = eager.sequences.shape[1] - 16
    first = eager.sequences[0, prompt_width:].tolist()
    stop = next(t for t in eager.sequences[1, prompt_width + 4:].tolist() if t not in first)   # the second row's
    params = dict(eos_token_id=stop, max_new_tokens=14, **SEEDED)
    eager = generate(pair, prompts, False, generator=generators(kind), **params)
    lengths = [row.num_committed_tokens for row in eager.spec_stats_per_row]
    assert min(lengths) < max(lengths)                                    # rows finish at different cycles
    compiled = generate(pair, prompts, True, generator=generators(kind), **params)
    assert_same_decode(eager, compiled)
    rows = compiled.spec_stats_per_row
    assert any(row.num_drafts_reaching_pos[-1] < row.num_drafts for row in rows)      # fewer drafts near a budget
    assert sum(row.num_bonus_tokens for row in rows) > 0 and sum(row.num_recovered_tokens for row in rows) > 0
    assert seeded_keys(pair) >= {"deer-draft", "deer-verify"} and one_graph_each(pair)
    other = generate(pair, prompts, True, generator=generators(kind, seed=9), **params)
    assert other.sequences.tolist() != compiled.sequences.tolist()         # the draws come from the generators


@pytest.mark.parametrize("kind", fast_first(["shared", "per-row"]))
def test_seeded_batch_of_one_equals_the_eager_runtime(pair, kind):
    """Seeded, batch 1, a drafter-less last cycle (one AR step: the bonus token drawn, no uniform); the generators
    end in the eager runtime's state (the same amount drawn)."""
    params = dict(max_new_tokens=12, eos_token_id=None, **SEEDED)
    used = {compiled: generators(kind, 1) for compiled in (False, True)}
    eager = generate(pair, pair[3][:1], False, generator=used[False], **params)
    compiled = generate(pair, pair[3][:1], True, generator=used[True], **params)
    assert_same_decode(eager, compiled)
    assert compiled.spec_stats.num_fallback_tokens == 1
    assert generator_states(used[False]) == generator_states(used[True])


@pytest.mark.slow
def test_argmax_drafts_with_rejection_sampling_equal_the_eager_runtime(pair):
    """do_sample=False with acceptance="rejection_sampling" and a generator (the reference code's random acceptance
    of argmax drafts): greedy drafts, the verification's draws made before the verify step; the eager runtime's
    tokens and counters (keys of their own: slow tier)."""
    params = dict(acceptance="rejection_sampling", max_new_tokens=14, eos_token_id=None)
    eager = generate(pair, pair[3], False, generator=generators("shared"), **params)
    assert_same_decode(eager, generate(pair, pair[3], True, generator=generators("shared"), **params))
    assert sum(row.num_recovered_tokens for row in eager.spec_stats_per_row) > 0


@pytest.mark.slow
def test_seeded_64_token_call_one_graph_per_key_one_read_per_cycle(pair, step_syncs):
    """Seeded, batch 1, 64 tokens: each key compiled once (fullgraph), a second call reuses them, gives the same
    tokens from the same seed, and reads the device at most once per cycle of two forwards (the draws are made on
    the host side of the steps and read nothing)."""
    params = dict(max_new_tokens=64, eos_token_id=None, **SEEDED)
    for model in pair[1:3]:                     # whatever ran before: the first call allocates (eager prefill)
        clear_static_state(model)
    generate(pair, pair[3][:1], True, generator=generators("shared"), **params)
    first = generate(pair, pair[3][:1], True, generator=generators("shared"), **params)
    keys = deer_keys(pair)
    assert seeded_keys(pair) == {"deer-draft", "deer-verify"} and one_graph_each(pair)
    assert {key[0] for key in keys} == {"deer-prefill", "deer-draft", "deer-verify"}
    with step_syncs.counting() as syncs:
        second = generate(pair, pair[3][:1], True, generator=generators("shared"), **params)
    assert deer_keys(pair) == keys and one_graph_each(pair)
    assert second.sequences.tolist() == first.sequences.tolist()
    assert len(step_syncs.before) > 8
    assert step_syncs.per_step() <= 0.5, syncs.by_site.most_common(4)


def stream_site(site: tuple[str, int]) -> bool:
    """Whether a counted read's site is the stream's (its cut, copy and draft check: `TokenStream`, `RowEnds`,
    `DecodingStrategy.stream_draft`), which the compiled cycle feeds with tensors made on the host from its read."""
    path, line = site
    lines, first = inspect.getsourcelines(DecodingStrategy.stream_draft)
    rows_end = inspect.getsourcelines(RowRequest)[1]            # rows.py above it: where each row's output ends
    return (path.endswith("strategies/streaming.py") or (path.endswith("integration/rows.py") and line < rows_end)
            or (path.endswith("strategies/base.py") and first <= line < first + len(lines)))


@pytest.mark.parametrize("params", [dict(), SEEDED], ids=["greedy", "seeded"])
@pytest.mark.slow
def test_a_streamer_gets_the_eager_calls(pair, params, step_syncs):
    """Batch 1 with a streamer: compiled, the same `put` (committed tokens) and `put_draft` (the drafter's proposals
    before verification) calls in the same order as the eager runtime, taken from each cycle's one read (a
    drafter-less last cycle sends no draft). The streamer adds no device read: the reads counted with it, but the
    stream's own (on tensors made on the host from the read) and the test streamer's, are those of the same call
    without it (at most one per cycle: the other tests)."""

    def call(compiled: bool, streamer=None):
        seed = dict(generator=generators("shared")) if params else {}
        out = generate(pair, pair[3][:1], compiled, streamer=streamer, max_new_tokens=14, eos_token_id=None,
                       **params, **seed)
        return out.sequences.tolist(), None if streamer is None else streamer.events

    eager = call(False, Recorder())
    assert call(True, Recorder()) == eager
    kinds = [kind for kind, _ in eager[1]]
    assert kinds.count("draft") > 2 and kinds[-1] == "end"
    assert (seeded_keys(pair) if params else {key[0] for key in deer_keys(pair)}) >= {"deer-draft", "deer-verify"}
    with step_syncs.counting() as streamed:
        assert call(True, Recorder()) == eager
    with step_syncs.counting() as plain:
        assert call(True)[0] == eager[0]
    assert device_reads(streamed) == device_reads(plain)


def device_reads(syncs) -> Counter:
    """Counted reads by site, but the stream's sites (:func:`stream_site`; the output's cut uses one of them too) and
    those outside the library (the test streamer's, transformers' put of the prompt)."""
    outside = ("<outside>", 0)
    return +Counter({site: n for site, n in syncs.by_site.items() if not stream_site(site) and site != outside})


def test_a_graph_break_in_the_step_raises(pair, monkeypatch):
    """fullgraph=True: a graph break in the verify step's maths (here in greedy_match) raises instead of running
    slowly (k = 2: keys of its own, traced anew). The models' static state is dropped afterwards: the failed key
    has no graph, and whichever test runs next in this process counts graphs per key."""
    match = deer.greedy_match

    def breaking(*args, **kwargs):
        torch._dynamo.graph_break()
        return match(*args, **kwargs)

    monkeypatch.setattr(deer, "greedy_match", breaking)
    try:
        with pytest.raises(torch._dynamo.exc.Unsupported):
            generate(pair, pair[3][:1], True, max_new_tokens=12, block_size=2)
    finally:
        for model in pair[1:3]:
            clear_static_state(model)


@pytest.mark.parametrize("sampled", fast_first([False, True]), ids=["greedy", "seeded"])
def test_the_full_drafter_layout_equals_the_eager_runtime(pair, sampled):
    """The "full" drafter layout (DEER App. F: each row's whole context recomputed every cycle, nothing stored in
    the drafter): a left-padded batch of 2, 24 tokens, the contexts crossing a width bucket; greedy, and seeded with
    a generator per row; the eager runtime's tokens and per-row counters, the drafter step compiled once per
    context width bucket."""
    params = dict(draft_attention="full", max_new_tokens=24, eos_token_id=None, **(SEEDED if sampled else {}))

    def call(compiled: bool):
        return generate(pair, pair[3], compiled, **params, **({"generator": generators("per-row")} if sampled else {}))

    eager = call(False)
    clear(pair)
    assert_same_decode(eager, call(True))
    widths = [key[1] for key in deer_keys(pair) if key[0] == "deer-draft-full"]
    assert len(widths) >= 2 and one_graph_each(pair)                   # two buckets, each compiled once


def test_one_token_prompts_run_their_first_cycle_eagerly(pair, monkeypatch):
    """A batch of one-token prompts prefills nothing (the target has no carry yet): its first cycle runs eagerly
    (:meth:`DeerStrategy.first_input` is None), every later one compiled; the eager runtime's tokens and counters."""
    tokenizer, target, drafter, prompts = pair
    ids = torch.tensor([[tokenizer(prompts[0]).input_ids[0]], [tokenizer(prompts[1]).input_ids[-1]]])

    def call(compiled: bool):
        static = dict(cache_implementation="static", compile_config=cpu_compile_config()) if compiled else {}
        return target.generate(ids, return_dict_in_generate=True, custom_generate=hf_dllm_spec.custom_generate,
                               decoding_strategy="deer", draft_model=drafter, block_size=4, max_new_tokens=12,
                               eos_token_id=None, **static)

    eager = call(False)
    eager_cycles = []
    cycle = deer.DeerStrategy.cycle
    monkeypatch.setattr(deer.DeerStrategy, "cycle", lambda self: eager_cycles.append(1) or cycle(self))
    assert_same_decode(eager, call(True))
    assert len(eager_cycles) == 1 and {key[0] for key in deer_keys(pair)} >= {"deer-draft", "deer-verify"}


@pytest.mark.slow
@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded"])
def test_rows_that_join_get_the_eager_runtime_tokens(pair, sampled, monkeypatch):
    """Continuous batching (`row_feed`): two rows start, two join at the third join point (the static buffers
    double); every cycle is compiled, the one after the join too (its drafter step reads the joining rows' whole
    prompts at their width bucket, as a call's first cycle does); greedy, and seeded (rejection sampling, every row
    its own generator, a joining row with its own temperature and top-k: per-row processors); every row's tokens,
    end and counters equal the eager runtime's."""
    tokenizer = pair[0]
    prompts = [tokenizer(p.text).input_ids for p in arithmetic_prompts(AR_DIR, 4)]

    def run(compiled: bool) -> dict:
        results: dict = {}

        def request(n: int) -> RowRequest:
            own = dict(generator=torch.Generator().manual_seed(n)) if sampled else {}
            if sampled and n == 2:                                                # its own settings
                own.update(temperature=0.7, top_k=5)
            return RowRequest(prompts[n], 12, **own, on_done=lambda tokens, reason, stats: results.__setitem__(
                n, (tokens, reason, spec_counters(stats))))

        initial = [request(0), request(1)]
        sampling = dict(do_sample=True, top_k=20, generator=[r.generator for r in initial]) if sampled else {}
        generate(pair, [tokenizer.decode(p) for p in prompts[:2]], compiled, max_new_tokens=12, eos_token_id=None,
                 row_feed=ScriptedFeed(initial, {3: [request(2), request(3)]}), **sampling)
        return results

    clear(pair)
    eager = run(False)
    eager_cycles = []
    cycle = deer.DeerStrategy.cycle
    monkeypatch.setattr(deer.DeerStrategy, "cycle", lambda self: eager_cycles.append(1) or cycle(self))
    assert sorted(eager) == [0, 1, 2, 3] and run(True) == eager
    assert not eager_cycles                                    # the first cycle and the one after the join compiled
    rows_buckets = {key[-6] for key in deer_keys(pair) if key[0] == "deer-verify"}
    assert 4 in rows_buckets and one_graph_each(pair)          # the cycles after the join compiled, at 4 rows
    clear(pair)


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("cc") is None,
                    reason="torch.compile (inductor) needs a C++ compiler on the CPU")
def test_inductor_compiled_steps_give_the_eager_tokens(pair):
    """Inductor (transformers' default backend), one prompt, 8 tokens (few keys: the inductor compilation is the
    cost; batches and padding are checked with dynamo's "eager" backend above), twice: the eager runtime's tokens
    and counters, from fresh caches (the first call's prefill and first cycle eager: a compiled step never
    allocates a cache) and then from the caches it left (every step compiled)."""
    clear(pair)
    prompts, params = pair[3][:1], dict(max_new_tokens=8)
    eager = generate(pair, prompts, False, **params)
    assert_same_decode(eager, generate(pair, prompts, "inductor", **params))
    assert {key[0] for key in deer_keys(pair)} == {"deer-draft", "deer-verify"}
    assert_same_decode(eager, generate(pair, prompts, "inductor", **params))
    assert {key[0] for key in deer_keys(pair)} == {"deer-prefill", "deer-draft", "deer-verify"}
    clear(pair)
