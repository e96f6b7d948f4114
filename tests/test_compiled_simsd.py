"""SimSD's cycle as compiled functions (issue 34, phases 3-4): under `cache_implementation="static"` with a
`compile_config` on both models, greedy or seeded SimSD runs each drafter step as one compiled function on the
drafter (forward, the drafter's unmasking rule, the step map) and the verify and commit as one compiled function on
the target (the paired layout at its full width 2B, or the stacked one at its most copies; greedy_match or rejection
sampling, the EOS gate, the commits, the next blocks), each with one host read.

Checked on the CPU with tiny random SDAR models (target and a drafter of other weights, or the target drafting for
itself: low and high acceptance): the eager runtime's tokens and per-row counters (batch 1, left-padded batches of 2
and 3 whose rows stop at different cycles, both verification orders, the EOS gate, several reveals per drafter step,
the dynamic drafter rule, blocks finished by the target alone, the stacked layout, rows that join), fullgraph (a
graph break raises), one graph per key over a 64-token call and a second call, at most one host read per forward
there. Seeded (rejection sampling, the drafter sampling; a shared generator and one per row): the eager runtime's
tokens and counters from the same seeds (batch 1, left-padded batches, blocks finished by the target alone, the
stacked layout, rejection sampling of greedy drafts), one graph per key and one host read per forward over a
64-token call; sampling with the EOS gate (the gate fires). Streaming (batch 1, greedy and seeded): the eager
runtime's `put` / `put_draft` / `end` calls, no host read added outside the streamer's own code. The full paired
layout gives the compacted layout's tokens (eager). Dynamo's
"eager" backend (the trace and its guards); the slow tests run the other cases and the bundled pair
(models/sdar-large drafted by models/sdar-tiny-arith).
"""

from __future__ import annotations

import contextlib
import inspect

import pytest
import torch
from conftest import (MASK_ID, TINY, Recorder, ScriptedFeed, assert_same_decode, cpu_compile_config, generator_states,
                      left_padded_batch, load_first_layers, spec_counters)

from hf_dllm_spec.integration.rows import RowRequest
from hf_dllm_spec.maths.masks import temporal_verify_mask
from hf_dllm_spec.runtime.static import clear_static_state, static_states
from hf_dllm_spec.strategies import simsd
from model_patches.sdar import SDARConfig, SDARForCausalLM

pytestmark = pytest.mark.usefixtures("as_users_run_it")

#: case -> (whether the target drafts for itself, rows, parameters); 3 rows run at a bucket of 4 (a zero row), in a
#: few cases of greedy and seeded SimSD: each rows bucket is a set of graphs to compile (these tests' cost)
CASES = {
    "self-drafter": (True, 2, {}),            # low_confidence_static, one reveal per step; drafts accepted
    "other-drafter": (False, 3, {}),          # every draft rejected
    "temporal-eos-gate": (True, 3, dict(verify_order="temporal", eos_min_prob=0.9)),
    "dynamic-two-steps": (True, 2, dict(remasking_strategy="low_confidence_dynamic", confidence_threshold=0.5,
                                        steps_per_block=2)),               # several reveals per drafter step
    "min-draft-len": (False, 2, dict(min_draft_len=3)),   # blocks with 1-2 masks left: the target alone
    "stacked": (True, 2, dict(verify_layout="stacked")),  # B copies, those past a row's last step unread
}


@pytest.fixture(scope="module")
def drafter():
    torch.manual_seed(1)
    return SDARForCausalLM(SDARConfig(block_size=4, mask_token_id=MASK_ID, **TINY)).eval()


def generate(target, drafter, ids, mask, compiled: bool, **kwargs):
    """`compiled`: False (the eager runtime) or True (static runtime, dynamo's "eager" backend)."""
    static = dict(cache_implementation="static", compile_config=cpu_compile_config()) if compiled else {}
    return target.generate(ids, attention_mask=mask, return_dict_in_generate=True, **{
        "decoding_strategy": "simsd", "draft_model": drafter, "block_size": 4, "draft_block_size": 4,
        "max_new_tokens": 16, "pad_token_id": 0, **static, **kwargs})


def simsd_keys(*models) -> list[tuple]:
    return [key for model in models for state in static_states(model) for key in state.steps.keys
            if key[0] in ("simsd-draft", "simsd-verify")]


def one_graph_each(*models) -> bool:
    return all(state.steps.graphs(key) == 1 for model in models for state in static_states(model)
               for key in state.steps.keys)


def clear(*models) -> None:
    for model in models:
        clear_static_state(model)


def batch():
    """Three left-padded prompts (7, 3 and 5 tokens: prompt tails of 3, 3 and 1 in the first block)."""
    ids, mask, _ = left_padded_batch([7, 3, 5], seed=3)
    return ids, mask


@pytest.mark.parametrize("case", [pytest.param(case, marks=() if case == "self-drafter" else pytest.mark.slow)
                                  for case in CASES])
def test_tokens_and_counters_equal_the_eager_runtime(sdar_model, drafter, case):
    """A left-padded batch of 2 or 3 whose second row stops early (a stop id it generates), so the cycles run at
    fewer rows after it: tokens and every per-row counter (forwards by kind, drafter forwards, denoising steps,
    drafts, accepted, recovered, committed, per-position acceptance) equal the eager runtime's."""
    own_drafter, rows, params = CASES[case]
    draft = sdar_model if own_drafter else drafter
    clear(sdar_model, draft)
    ids, mask = batch()
    ids, mask = ids[:rows], mask[:rows]
    free = generate(sdar_model, draft, ids, mask, False, **params)
    stop = free.sequences[1, ids.shape[1] + 5].item()
    eager = generate(sdar_model, draft, ids, mask, False, eos_token_id=stop, **params)
    compiled = generate(sdar_model, draft, ids, mask, True, eos_token_id=stop, **params)
    assert_same_decode(eager, compiled)
    lengths = [int((row[ids.shape[1]:] != 0).sum()) for row in eager.sequences]
    assert len(set(lengths)) > 1, lengths                       # rows finished at different cycles
    stats = compiled.spec_stats
    if params.get("verify_layout") == "stacked":       # exact: the target accepts every draft it made itself
        assert stats.num_recovered_tokens == 0 and stats.num_accepted_tokens > 0
    else:
        assert stats.num_recovered_tokens > 0 and (stats.num_accepted_tokens > 0) == own_drafter
    if "min_draft_len" in params:
        assert stats.num_fallback_tokens > 0
    assert {key[0] for key in simsd_keys(sdar_model, draft)} == {"simsd-draft", "simsd-verify"}
    assert one_graph_each(sdar_model, draft)


@pytest.mark.slow
def test_one_graph_per_key_and_one_host_read_per_forward_over_a_64_token_call(sdar_model, drafter, step_syncs):
    """Batch 1, a 64-token call: the eager runtime's tokens and counters; each key (drafter step with and without a
    pending block, verify with and without; per attended prefix) compiled once, fullgraph; a second call of new
    strategy and runner objects reuses them all, and between its first and last compiled call the loop reads the
    device at most once per forward (each drafter step's rows still drafting, the verify step's cycle read). Inside
    the compiled functions nothing reads it (fullgraph), and the counter is paused there (dynamo would trace into
    it)."""
    clear(sdar_model, drafter)
    ids, mask = batch()
    ids, mask, params = ids[:1], mask[:1], dict(max_new_tokens=64, eos_token_id=None)
    first = generate(sdar_model, drafter, ids, mask, True, **params)
    assert_same_decode(generate(sdar_model, drafter, ids, mask, False, **params), first)
    keys = simsd_keys(sdar_model, drafter)
    assert {key[0] for key in keys} == {"simsd-draft", "simsd-verify"} and one_graph_each(sdar_model, drafter)
    with step_syncs.counting() as syncs:
        second = generate(sdar_model, drafter, ids, mask, True, **params)
    assert simsd_keys(sdar_model, drafter) == keys and one_graph_each(sdar_model, drafter)
    assert second.sequences.tolist() == first.sequences.tolist()
    stats = first.spec_stats
    assert stats.num_forward_calls == 2 + stats.num_draft_forwards + stats.num_verify_forwards   # 2 prefills
    assert stats.num_verify_forwards > 3 and len(step_syncs.before) == stats.num_forward_calls - 2
    assert step_syncs.per_step() <= 1.0, syncs.by_site.most_common(4)


def loop_syncs(syncs) -> int:
    """Host reads counted in the decoding loop (strategies/, runtime/) outside the streamer's own code (TokenStream,
    `stream_draft`), which a compiled cycle hands CPU tensors built from its read (on the CPU the counter cannot tell
    them from device reads); the call's setup (integration/) is not counted either."""
    from hf_dllm_spec.strategies.base import DecodingStrategy

    lines, first = inspect.getsourcelines(DecodingStrategy.stream_draft)
    stream_draft = range(first, first + len(lines))
    return sum(n for (file, line), n in syncs.by_site.items()
               if file.startswith(("hf_dllm_spec/strategies/", "hf_dllm_spec/runtime/"))
               and not file.endswith("streaming.py") and not (file.endswith("base.py") and line in stream_draft))


#: streamed case -> parameters (batch 1)
STREAMED = {
    "greedy": dict(min_draft_len=2),
    "seeded": dict(do_sample=True, top_k=20),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(STREAMED))
def test_a_streamer_gets_the_eager_calls_from_the_cycle_read(sdar_model, drafter, step_syncs, case):
    """Batch 1 with a `put_draft` streamer: the compiled cycle runs (the key says a streamer reads) and the
    streamer receives exactly the eager runtime's `put` / `put_draft` / `end` calls, with its tokens and counters;
    the loop of a second call reads the device exactly as often as without a streamer outside the streamer's own
    code (the drafts come with the verify step's read; without a streamer: at most once per forward, the test
    above)."""
    params = dict(STREAMED[case], max_new_tokens=24, eos_token_id=None)
    fresh = (lambda: dict(generator=torch.Generator().manual_seed(0))) if "do_sample" in params else dict
    clear(sdar_model, drafter)
    ids, mask = batch()
    ids, mask = ids[:1], mask[:1]
    runs, syncs = [], []
    for compiled, streamer in ((False, Recorder()), (True, Recorder()), (True, Recorder()), (True, None)):
        with step_syncs.counting() if len(runs) >= 2 else contextlib.nullcontext() as counter:
            runs.append(generate(sdar_model, drafter, ids, mask, compiled, streamer=streamer, **params, **fresh()))
        runs[-1].events = None if streamer is None else streamer.events
        syncs.append(counter)
        if len(runs) == 3:
            streamed = set(simsd_keys(sdar_model, drafter))
    eager, compiled, again, quiet = runs
    assert_same_decode(eager, compiled)
    assert compiled.events == eager.events == again.events
    assert again.sequences.tolist() == quiet.sequences.tolist() == eager.sequences.tolist()
    assert [kind for kind, _ in eager.events].count("draft") > 3 and eager.events[-1] == ("end", None)
    assert {key[0] for key in streamed} == {"simsd-draft", "simsd-verify"}
    assert streamed < set(simsd_keys(sdar_model, drafter))       # without a streamer: other keys (a narrower read)
    assert one_graph_each(sdar_model, drafter)
    assert loop_syncs(syncs[2]) == loop_syncs(syncs[3]), (sorted(syncs[2].by_site.items()),
                                                          sorted(syncs[3].by_site.items()))


def test_a_graph_break_in_the_cycle_raises(sdar_model, drafter, monkeypatch):
    """fullgraph=True: a graph break in the verify step's maths (here in the Eq. 1 mask) raises."""
    mask_of = simsd.temporal_verify_mask

    def breaking(reveal_step):
        torch._dynamo.graph_break()
        return mask_of(reveal_step)

    monkeypatch.setattr(simsd, "temporal_verify_mask", breaking)
    clear(sdar_model, drafter)
    ids, mask = batch()
    with pytest.raises(torch._dynamo.exc.Unsupported):
        generate(sdar_model, drafter, ids[:1], mask[:1], True, max_new_tokens=4)
    clear(sdar_model, drafter)


#: seeded case -> (whether the target drafts for itself, rows, generator: "shared" or "per-row", parameters)
SEEDED = {
    "shared": (False, 3, "shared", dict(min_draft_len=3)),           # the target's own draws for short blocks
    "batch-1": (True, 1, "shared", {}),
    "per-row-self-drafter": (True, 2, "per-row", {}),
    "per-row-min-draft-len": (False, 3, "per-row", dict(min_draft_len=3)),
    "stacked-dynamic": (True, 2, "per-row", dict(verify_layout="stacked", remasking_strategy="low_confidence_dynamic",
                                                 confidence_threshold=0.5, steps_per_block=2)),
    "greedy-rejection": (False, 2, "shared", dict(do_sample=False, acceptance="rejection_sampling")),
}


def seeded(kind: str, rows: int) -> dict:
    """Fresh generators: one shared, or one per row (seeds 0, 1, ...); sampling at temperature 1 with top-k."""
    generator = (torch.Generator().manual_seed(0) if kind == "shared"
                 else [torch.Generator().manual_seed(r) for r in range(rows)])
    return dict(do_sample=True, top_k=20, generator=generator)


@pytest.mark.parametrize("case", [pytest.param(case, marks=() if case == "shared" else pytest.mark.slow)
                                  for case in SEEDED])
def test_seeded_tokens_and_counters_equal_the_eager_runtime(sdar_model, drafter, case):
    """Sampled SimSD (rejection sampling; the drafter's sampled steps), a shared generator or one per row: a
    left-padded batch whose rows stop at different cycles (or batch 1) gets the eager runtime's tokens and every
    per-row counter from the same seeds, and the compiled cycle ran (every random number drawn before the
    compiled call that uses it, in the eager order)."""
    own_drafter, rows, kind, params = SEEDED[case]
    draft = sdar_model if own_drafter else drafter
    clear(sdar_model, draft)
    ids, mask = batch()
    ids, mask = ids[:rows], mask[:rows]
    free = generate(sdar_model, draft, ids, mask, False, **{**seeded(kind, rows), **params})
    params = {**params, **({"eos_token_id": free.sequences[-1, ids.shape[1] + 5].item()} if rows > 1 else {})}
    eager = generate(sdar_model, draft, ids, mask, False, **{**seeded(kind, rows), **params})
    compiled = generate(sdar_model, draft, ids, mask, True, **{**seeded(kind, rows), **params})
    assert_same_decode(eager, compiled)
    if rows > 1:
        lengths = [int((row[ids.shape[1]:] != 0).sum()) for row in eager.sequences]
        assert len(set(lengths)) > 1, lengths                       # rows finished at different cycles
    stats = compiled.spec_stats
    assert stats.num_accepted_tokens > 0
    if params.get("verify_layout") != "stacked":     # stacked, own drafts: the exact target accepts them all
        assert stats.num_recovered_tokens > 0
    if "min_draft_len" in params:
        assert stats.num_fallback_tokens > 0
    assert {key[0] for key in simsd_keys(sdar_model, draft)} == {"simsd-draft", "simsd-verify"}
    assert one_graph_each(sdar_model, draft)
    other = dict(seeded(kind, rows), generator=(torch.Generator().manual_seed(7) if kind == "shared" else
                                                [torch.Generator().manual_seed(7 + r) for r in range(rows)]))
    assert generate(sdar_model, draft, ids, mask, True, **{**other, **params}).sequences.tolist() != \
        compiled.sequences.tolist()                                 # the draws matter


@pytest.mark.slow
def test_sampled_cycle_one_graph_per_key_and_one_host_read_per_forward(sdar_model, drafter, step_syncs):
    """Sampled, batch 1, a 64-token call with a shared generator: one graph per key, fullgraph; a second call
    reuses them and reads the device at most once per forward (the draws are made on the device before each
    compiled call, no read)."""
    clear(sdar_model, drafter)
    ids, mask = batch()
    ids, mask, params = ids[:1], mask[:1], dict(max_new_tokens=64, eos_token_id=None)
    first = generate(sdar_model, drafter, ids, mask, True, **seeded("shared", 1), **params)
    assert_same_decode(generate(sdar_model, drafter, ids, mask, False, **seeded("shared", 1), **params), first)
    keys = simsd_keys(sdar_model, drafter)
    assert {key[0] for key in keys} == {"simsd-draft", "simsd-verify"} and one_graph_each(sdar_model, drafter)
    with step_syncs.counting() as syncs:
        second = generate(sdar_model, drafter, ids, mask, True, **seeded("shared", 1), **params)
    assert simsd_keys(sdar_model, drafter) == keys and one_graph_each(sdar_model, drafter)
    assert second.sequences.tolist() == first.sequences.tolist()
    stats = first.spec_stats
    assert stats.num_verify_forwards > 3 and len(step_syncs.before) == stats.num_forward_calls - 2
    assert step_syncs.per_step() <= 1.0, syncs.by_site.most_common(4)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["per-row", "shared"])
def test_sampling_with_the_eos_gate_equals_the_eager_runtime(sdar_model, drafter, kind, monkeypatch):
    """Sampling with the EOS gate (`eos_min_prob`): the replacement's noise is drawn for every row before the verify
    step (the eager cycle draws it too, whether the gate fires or not), so a left-padded batch of 2 gets the eager
    runtime's tokens, counters and generator states from the compiled cycle; the gate fires in this run (a frequent
    token as the stop id, gated at 1.0: every time it arrives as a correction)."""
    clear(sdar_model, drafter)
    ids, mask = batch()
    ids, mask = ids[:2], mask[:2]
    generated = generate(sdar_model, drafter, ids, mask, False, **seeded(kind, 2)).sequences[:, ids.shape[1]:]
    generated = generated.flatten().tolist()
    params = dict(eos_token_id=max(set(generated), key=generated.count), eos_min_prob=1.0)
    fired, gate = [], simsd.gate_stop_tokens

    def spy(committed, *args, **kwargs):
        out = gate(committed, *args, **kwargs)
        fired.append(not torch.equal(out, committed))
        return out

    eager_params, compiled_params = seeded(kind, 2), seeded(kind, 2)
    with monkeypatch.context() as patch:
        patch.setattr(simsd, "gate_stop_tokens", spy)
        eager = generate(sdar_model, drafter, ids, mask, False, **eager_params, **params)
    assert any(fired)
    compiled = generate(sdar_model, drafter, ids, mask, True, **compiled_params, **params)
    assert_same_decode(eager, compiled)
    assert generator_states(eager_params["generator"]) == generator_states(compiled_params["generator"])
    assert {key[0] for key in simsd_keys(sdar_model, drafter)} == {"simsd-draft", "simsd-verify"}
    assert one_graph_each(sdar_model, drafter)


def test_the_full_paired_layout_gives_the_compacted_tokens(sdar_model, drafter, monkeypatch):
    """The compiled verify step reads the paired layout at its full width 2B; on the eager runtime that layout gives
    the compacted layout's tokens and counters (the dropped tokens are keys of no kept token)."""
    ids, mask = batch()
    compacted = generate(sdar_model, drafter, ids, mask, False, max_new_tokens=24)

    def full(ids, positions, reveal_step):
        width = reveal_step.shape[1]
        slots = torch.arange(width, 2 * width).expand(reveal_step.shape[0], -1)
        return ids, positions, temporal_verify_mask(reveal_step), slots

    monkeypatch.setattr(simsd, "compact_paired_layout", full)
    assert_same_decode(compacted, generate(sdar_model, drafter, ids, mask, False, max_new_tokens=24))


@pytest.mark.slow
def test_rows_that_join_get_the_eager_runtime_tokens(sdar_model):
    """Continuous batching (`row_feed`): two rows start, two join before the third cycle (their first blocks' masks
    known on the host; the static buffers double); every row's tokens, end and counters equal the eager
    runtime's."""
    prompts = [[5, 17, 42, 8, 23, 61, 4], [9, 3], [11, 12, 13, 14, 15, 16, 17, 18, 19], [7]]

    def run(compiled: bool) -> dict:
        results: dict = {}

        def request(n: int) -> RowRequest:
            return RowRequest(prompts[n], 10, on_done=lambda tokens, reason, stats: results.__setitem__(
                n, (tokens, reason, spec_counters(stats))))

        initial = [request(0), request(1)]
        ids = torch.tensor([prompts[0], [0] * 5 + prompts[1]])
        generate(sdar_model, sdar_model, ids, (ids != 0).long(), compiled, max_new_tokens=10,
                 row_feed=ScriptedFeed(initial, {3: [request(2), request(3)]}))
        return results

    clear(sdar_model)
    eager = run(False)
    assert sorted(eager) == [0, 1, 2, 3] and run(True) == eager
    assert {key[0] for key in simsd_keys(sdar_model)} == {"simsd-draft", "simsd-verify"}
    clear(sdar_model)


@pytest.mark.slow
def test_sampled_rows_that_join_get_the_eager_runtime_tokens(sdar_model, drafter):
    """Continuous batching, sampled (rejection sampling, every row its own generator; a joining row with its own
    temperature and top-k: per-row processors): two rows start, two join before the third cycle (the static buffers
    and the draw buffers double); every row's tokens, end and counters equal the eager runtime's from the same
    seeds."""
    prompts = [[5, 17, 42, 8, 23, 61, 4], [9, 3], [11, 12, 13, 14, 15, 16, 17, 18, 19], [7]]

    def run(compiled: bool) -> dict:
        results: dict = {}

        def request(n: int) -> RowRequest:
            return RowRequest(prompts[n], 10, generator=torch.Generator().manual_seed(n),
                              **(dict(temperature=0.7, top_k=5) if n == 2 else {}),     # its own settings
                              on_done=lambda tokens, reason, stats: results.__setitem__(
                                  n, (tokens, reason, spec_counters(stats))))

        initial = [request(0), request(1)]
        ids = torch.tensor([prompts[0], [0] * 5 + prompts[1]])
        generate(sdar_model, drafter, ids, (ids != 0).long(), compiled, max_new_tokens=10, do_sample=True,
                 generator=[r.generator for r in initial],
                 row_feed=ScriptedFeed(initial, {3: [request(2), request(3)]}))
        return results

    clear(sdar_model, drafter)
    eager = run(False)
    assert sorted(eager) == [0, 1, 2, 3] and run(True) == eager
    assert {key[0] for key in simsd_keys(sdar_model, drafter)} == {"simsd-draft", "simsd-verify"}
    clear(sdar_model, drafter)


@pytest.mark.slow
def test_the_bundled_pair_gives_the_eager_tokens():
    """models/sdar-large drafted by models/sdar-tiny-arith (benchmarks/host_work.py's pair; their first 4 and 2
    layers, `conftest.load_first_layers`: dynamo traces each forward once per key), a left-padded batch of 2: the
    eager runtime's tokens and counters."""
    tokenizer, target = load_first_layers("sdar-large", 4)
    drafter = load_first_layers("sdar-tiny-arith")[1]
    enc = tokenizer(["12+7=", "3*4+25="], return_tensors="pt", padding=True)
    kwargs = dict(decoding_strategy="simsd", draft_model=drafter, max_new_tokens=16, return_dict_in_generate=True)
    eager = target.generate(enc.input_ids, attention_mask=enc.attention_mask, **kwargs)
    compiled = target.generate(enc.input_ids, attention_mask=enc.attention_mask, cache_implementation="static",
                               compile_config=cpu_compile_config(), **kwargs)
    assert_same_decode(eager, compiled)
    assert {key[0] for key in simsd_keys(target, drafter)} == {"simsd-draft", "simsd-verify"}
    clear(target, drafter)


@pytest.mark.slow
def test_sampled_rows_shorter_than_a_block_with_their_own_settings(sdar_model, drafter):
    """Continuous batching, sampled: three rows whose prompts are all shorter than a block (the prefill stores
    nothing, so the first cycle runs eagerly at the rows bucket of 4 on fresh caches), one with its own
    temperature: the per-row processors take the padded bucket (they raised before), and every row's tokens, end and
    counters equal the eager runtime's."""
    prompts = [[5, 17], [9, 3, 4], [11]]

    def run(compiled: bool) -> dict:
        results: dict = {}
        requests = [RowRequest(p, 6, generator=torch.Generator().manual_seed(n),
                               **(dict(temperature=0.7) if n == 1 else {}),
                               on_done=lambda tokens, reason, stats, n=n: results.__setitem__(
                                   n, (tokens, reason, spec_counters(stats))))
                    for n, p in enumerate(prompts)]
        ids = torch.tensor([[0, 5, 17], [9, 3, 4], [0, 0, 11]])
        generate(sdar_model, drafter, ids, (ids != 0).long(), compiled, max_new_tokens=6, do_sample=True,
                 generator=[r.generator for r in requests], row_feed=ScriptedFeed(requests, {}))
        return results

    clear(sdar_model, drafter)
    eager = run(False)
    assert sorted(eager) == [0, 1, 2] and run(True) == eager
    clear(sdar_model, drafter)
