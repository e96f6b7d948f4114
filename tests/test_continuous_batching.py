"""Continuous batching in the library (`generate(row_feed=...)`): rows that join a running batch, at any join point,
get the tokens of their own batch-1 call; cancelled rows leave at once; bad joining requests are refused alone.

Every strategy that takes joining rows (the block strategies on SDAR, Fast-dLLM v2 and LLaDA2, S2D2 on each, SimSD),
DEER (between two cycles), greedy and seeded sampling, eager and static runtime.
"""

from __future__ import annotations

import time
import warnings

import pytest
import torch
from conftest import MASK_ID, ScriptedFeed, fast_first, no_cyclic_garbage, tiny_family_models

import hf_dllm_spec
from hf_dllm_spec.integration.rows import RowRequest

PAD = 0


MODELS = tiny_family_models()

#: case -> (target, drafter, strategy, parameters)
CASES = {
    "ar": ("sdar", None, "ar", {}),
    "block_diffusion": ("sdar", None, "block_diffusion", {"block_size": 4, "confidence_threshold": 0.6}),
    "block_diffusion_separate_writes": ("sdar", None, "block_diffusion", {"block_size": 2, "fuse_cache_write": False}),
    "s2d2": ("sdar", None, "s2d2", {"block_size": 4}),
    "fast_dllm_v2": ("fast", None, "fast_dllm_v2", {"block_size": 8, "sub_block_size": 4}),
    "fast_dllm_v2_separate_writes": ("fast", None, "fast_dllm_v2", {"block_size": 4, "sub_block_size": 2,
                                                                     "fuse_cache_write": False}),
    "s2d2_fast_dllm_v2": ("fast", None, "s2d2", {"block_size": 8, "sub_block_size": 4}),
    "llada2": ("llada2", None, "llada2", {"block_size": 4}),
    "s2d2_llada2": ("llada2", None, "s2d2", {"block_size": 4, "preset": "llada2.1-mini-quality"}),
    "simsd": ("sdar", "sdar_drafter", "simsd", {"block_size": 4, "draft_block_size": 4}),
    "deer": ("qwen", "sdar_drafter", "deer", {"block_size": 4}),
    "deer_full_attention": ("qwen", "sdar_drafter", "deer", {"block_size": 4, "draft_attention": "full"}),
}
PROMPTS = [[5, 17, 42, 8, 23, 61, 4], [9, 3], [11, 12, 13, 14, 15, 16, 17, 18, 19], [7], [33, 34, 35, 36, 37]]
BUDGETS = [10, 6, 12, 9, 5]


def _call(case: str, ids, mask, budget: int, **extra):
    target, drafter, strategy, params = CASES[case]
    model = MODELS[target]
    kwargs = dict(params, **extra)
    if drafter:
        kwargs["draft_model"] = MODELS[drafter]
    if target == "qwen":
        kwargs["custom_generate"] = hf_dllm_spec.custom_generate
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return model.generate(ids, attention_mask=mask, decoding_strategy=strategy, max_new_tokens=budget,
                              pad_token_id=PAD, **kwargs)


def _alone(case: str, n: int, eos=None, **extra) -> list[int]:
    out = _call(case, torch.tensor([PROMPTS[n]]), None, BUDGETS[n], eos_token_id=eos, **extra)
    return out[0, len(PROMPTS[n]):].tolist()


def _requests(indices, results: dict, seeds=None) -> list[RowRequest]:
    def done(n):
        return lambda tokens, reason, stats: results.__setitem__(n, (tokens, reason, stats))
    return [RowRequest(PROMPTS[n], BUDGETS[n], generator=torch.Generator().manual_seed(seeds[n]) if seeds else None,
                       on_done=done(n)) for n in indices]


def _continuous(case: str, joins: dict[int, list[int]], eos=None, seeds=None, **extra):
    """Rows 0 and 1 start; the rows of `joins[k]` join at join point k. Returns {row: (tokens, reason, stats)}."""
    results: dict = {}
    initial = _requests([0, 1], results, seeds)
    feed = ScriptedFeed(initial, {k: _requests(rows, results, seeds) for k, rows in joins.items()})
    width = max(len(PROMPTS[0]), len(PROMPTS[1]))
    ids = torch.tensor([[PAD] * (width - len(PROMPTS[n])) + PROMPTS[n] for n in (0, 1)])
    mask = (torch.arange(width)[None] >= torch.tensor([[width - len(PROMPTS[n])] for n in (0, 1)])).long()
    if seeds:
        extra["generator"] = [r.generator for r in initial]
    _call(case, ids, mask, max(BUDGETS[:2]), row_feed=feed, eos_token_id=eos, **extra)
    return results, feed


def _stop_of(tokens: list[int], eos) -> list[int]:
    return tokens[: tokens.index(eos) + 1] if eos is not None and eos in tokens else tokens


@pytest.mark.parametrize("case", list(CASES))
def test_joining_rows_get_their_batch_1_tokens(case):
    joins = {1: [2], 3: [3, 4]}                 # before the first step, and mid-flight (rows mid-block)
    with no_cyclic_garbage(f"{case}, rows joining and leaving"):    # a server makes such calls all day
        results, _ = _continuous(case, joins)
    assert sorted(results) == [0, 1, 2, 3, 4]
    for n in range(5):
        tokens, reason, stats = results[n]
        assert tokens == _alone(case, n)[: len(tokens)] and len(tokens) == BUDGETS[n], (case, n)
        assert reason == "length" and stats.num_generated_tokens == len(tokens)
        assert stats.nfe > 0
        # the discarded tokens as a batch-1 call reports them (they were left at 0)
        alone = _call(case, torch.tensor([PROMPTS[n]]), None, BUDGETS[n], return_dict_in_generate=True)
        assert stats.num_discarded_tokens == stats.num_committed_tokens - len(tokens) \
            == alone.spec_stats_per_row[0].num_discarded_tokens, (case, n)


@pytest.mark.parametrize("case", ["block_diffusion", "s2d2", "llada2", "simsd", "deer"])
def test_joining_rows_with_a_stop_id(case):
    eos = _alone(case, 2)[2]                    # a token row 2 really produces: rows end at different steps
    results, _ = _continuous(case, {2: [2, 3]}, eos=eos)
    for n in range(4):
        tokens, reason, _ = results[n]
        alone = _call(case, torch.tensor([PROMPTS[n]]), None, BUDGETS[n], eos_token_id=eos)[0, len(PROMPTS[n]):]
        assert tokens == _stop_of(alone.tolist(), eos)[: BUDGETS[n]], (case, n)
        assert reason == ("stop" if tokens[-1] == eos else "length")


@pytest.mark.parametrize("case", ["block_diffusion", "s2d2", "simsd", "deer"])
def test_joining_rows_sampled_with_their_own_generators(case):
    seeds = [11, 12, 13, 14, 15]
    results, _ = _continuous(case, {2: [2], 4: [3, 4]}, seeds=seeds, do_sample=True, temperature=0.8)
    for n in range(5):
        alone = _call(case, torch.tensor([PROMPTS[n]]), None, BUDGETS[n], do_sample=True, temperature=0.8,
                      generator=[torch.Generator().manual_seed(seeds[n])])[0, len(PROMPTS[n]):]
        assert results[n][0] == alone.tolist()[: BUDGETS[n]], (case, n)


@pytest.mark.parametrize("case", ["block_diffusion", "s2d2", "fast_dllm_v2", "llada2", "deer"])
def test_static_runtime_takes_joining_rows(case):
    joins = {2: [2, 3, 4]}                      # more rows than the static buffers were made for: they double
    results, _ = _continuous(case, joins, cache_implementation="static")
    for n in range(5):
        assert results[n][0] == _alone(case, n), (case, n)


def test_cancelled_row_leaves_at_once_and_the_others_are_unchanged():
    results: dict = {}
    initial = _requests([0, 1], results)
    feed = ScriptedFeed(initial, {3: _requests([2], results)})
    original_take = feed.take

    def take(rows):
        if feed.calls == 1:
            initial[0].cancelled.set()          # row 0's client goes away after the first step
        return original_take(rows)

    feed.take = take
    width = len(PROMPTS[0])
    ids = torch.tensor([PROMPTS[0], [PAD] * (width - 2) + PROMPTS[1]])
    mask = (ids != PAD).long()
    _call("block_diffusion", ids, mask, 10, row_feed=feed)
    tokens, reason, stats = results[0]
    # set at join point 2, seen at join point 3: prefill and two denoising steps, then it leaves
    assert reason == "cancelled" and stats.nfe == 3
    assert len(tokens) < BUDGETS[0] and tokens == _alone("block_diffusion", 0)[: len(tokens)]
    for n in (1, 2):
        assert results[n][0] == _alone("block_diffusion", n)


def test_a_bad_joining_request_is_refused_alone():
    results, errors = {}, []
    bad = RowRequest([5, MASK_ID, 7], 4, on_error=errors.append)            # the mask token in its prompt
    too_long = RowRequest([5] * 250, 40, on_error=errors.append)            # beyond the model's 256 positions
    feed = ScriptedFeed(_requests([0, 1], results), {2: [bad, too_long, *_requests([2], results)]})
    width = len(PROMPTS[0])
    ids = torch.tensor([PROMPTS[0], [PAD] * (width - 2) + PROMPTS[1]])
    _call("block_diffusion", ids, (ids != PAD).long(), 10, row_feed=feed)
    assert [type(e) for e in errors] == [ValueError, ValueError]
    assert "mask token" in str(errors[0])
    assert "positions" in str(errors[1])
    assert results[2][0] == _alone("block_diffusion", 2)


def test_the_returned_rows_are_the_rows_on_done_got():
    """The call's sequences hold each starting row as its request ended it (its own budget, here 10 and 6 under a
    call budget of 8; they were cut by the call's budget and stop ids), and the statistics a callback got do not
    change afterwards."""
    results: dict = {}
    feed = ScriptedFeed(_requests([0, 1], results), {1: _requests([2], results)})    # and a row that joins
    width = len(PROMPTS[0])
    ids = torch.tensor([PROMPTS[0], [PAD] * (width - 2) + PROMPTS[1]])
    out = _call("block_diffusion", ids, (ids != PAD).long(), 8, row_feed=feed, return_dict_in_generate=True)
    assert 2 in results and len(out.spec_stats_per_row) == out.sequences.shape[0] == 2    # the call's rows alone
    for n in (0, 1):
        tokens, _, stats = results[n]
        assert len(tokens) == BUDGETS[n] and stats.num_generated_tokens == len(tokens)
        row = out.sequences[n, width:].tolist()
        assert row[: len(tokens)] == tokens and set(row[len(tokens):]) <= {PAD}
        assert out.spec_stats_per_row[n].num_generated_tokens == len(tokens)


def test_joining_requests_of_a_wrong_form_are_refused_alone():
    """In a sampling call, a joining request without its own generator (it failed the whole call, no row reported)
    and one whose prompt is a tensor (a RuntimeError mid-call) get their `on_error`; the other rows finish."""
    results, errors = {}, []
    seeds = [3, 4, 5]
    no_generator = RowRequest(PROMPTS[3], 4, on_error=errors.append)
    tensor_prompt = RowRequest(torch.tensor(PROMPTS[4]), 4, generator=torch.Generator().manual_seed(9),
                               on_error=errors.append)
    initial = _requests([0, 1], results, seeds)
    feed = ScriptedFeed(initial, {2: [no_generator, tensor_prompt, *_requests([2], results, seeds)]})
    width = len(PROMPTS[0])
    ids = torch.tensor([PROMPTS[0], [PAD] * (width - 2) + PROMPTS[1]])
    _call("block_diffusion", ids, (ids != PAD).long(), 12, row_feed=feed, do_sample=True,
          generator=[r.generator for r in initial])
    assert [type(e) for e in errors] == [ValueError, ValueError]
    assert str(errors[0]).startswith("`generator` (='NoneType')") and "`prompt_ids` (='<Tensor>')" in str(errors[1])
    assert sorted(results) == [0, 1, 2]


def test_row_feed_misuse_is_refused_before_any_forward():
    results: dict = {}
    feed = ScriptedFeed(_requests([0], results), {})
    ids = torch.tensor([PROMPTS[0], PROMPTS[0]])
    with pytest.raises(ValueError, match="row_feed"):
        _call("block_diffusion", ids, None, 10, row_feed=feed)
    with pytest.raises(ValueError, match=r"`max_time` \(='MaxTimeCriteria'\) must not be combined with `row_feed`"):
        _call("block_diffusion", torch.tensor([PROMPTS[0]]), None, 10, row_feed=feed, max_time=5.0)
    with pytest.raises(ValueError, match="generator"):
        _call("block_diffusion", torch.tensor([PROMPTS[0]]), None, 10, row_feed=feed, do_sample=True,
              generator=torch.Generator().manual_seed(0))
    assert not results


@pytest.mark.parametrize("case", ["block_diffusion", "s2d2", "deer"])
def test_ignore_eos_per_row(case):
    """A row with `ignore_eos` decodes to its budget beside rows that stop at the stop id (strategies with per-row
    stop rules); SimSD, whose EOS gate reads the stop ids, refuses it per row."""
    eos = _alone(case, 0)[1]
    results: dict = {}
    initial = _requests([0, 1], results)
    initial[0].ignore_eos = True
    feed = ScriptedFeed(initial, {})
    width = len(PROMPTS[0])
    ids = torch.tensor([PROMPTS[0], [PAD] * (width - 2) + PROMPTS[1]])
    _call(case, ids, (ids != PAD).long(), 10, row_feed=feed, eos_token_id=eos)
    assert results[0][0] == _alone(case, 0) and results[0][1] == "length"
    alone = _call(case, torch.tensor([PROMPTS[1]]), None, BUDGETS[1], eos_token_id=eos)[0, 2:].tolist()
    assert results[1][0] == _stop_of(alone, eos)[: BUDGETS[1]]


def test_ignore_eos_per_row_is_refused_where_the_stop_ids_shape_tokens():
    results: dict = {}
    initial = _requests([0], results)
    initial[0].ignore_eos = True
    with pytest.raises(ValueError, match="ignore_eos"):
        _call("simsd", torch.tensor([PROMPTS[0]]), None, 10, row_feed=ScriptedFeed(initial, {}))


@pytest.mark.parametrize("case", ["block_diffusion", "s2d2", "simsd", "deer"])
def test_rows_with_their_own_sampling_settings_share_a_batch(case):
    """Each row samples with its own temperature / top-k / top-p (and generator), also rows that join (two of them
    differ in top-p alone): each gets the tokens of its batch-1 `generate(do_sample=True, temperature=...,
    top_k=..., top_p=...)` call."""
    settings = [dict(temperature=0.7, top_k=5), dict(temperature=1.3, top_p=0.9),
                dict(temperature=0.5, top_k=20, top_p=0.3), dict(temperature=0.5, top_k=20, top_p=0.8), dict()]
    seeds = [21, 22, 23, 24, 25]
    results: dict = {}

    def request(n):
        return RowRequest(PROMPTS[n], BUDGETS[n], generator=torch.Generator().manual_seed(seeds[n]),
                          on_done=lambda tokens, reason, stats: results.__setitem__(n, tokens), **settings[n])

    initial = [request(0), request(1)]
    feed = ScriptedFeed(initial, {2: [request(2)], 3: [request(3), request(4)]})
    width = len(PROMPTS[0])
    ids = torch.tensor([PROMPTS[0], [PAD] * (width - 2) + PROMPTS[1]])
    _call(case, ids, (ids != PAD).long(), 12, row_feed=feed, do_sample=True, temperature=0.9,
          generator=[r.generator for r in initial])
    assert sorted(results) == list(range(5))
    for n in range(5):
        own = {"temperature": 0.9, **settings[n]}             # a setting the row leaves unset is the call's
        alone = _call(case, torch.tensor([PROMPTS[n]]), None, BUDGETS[n], do_sample=True,
                      generator=[torch.Generator().manual_seed(seeds[n])], **own)[0, len(PROMPTS[n]):]
        assert results[n] == alone.tolist()[: BUDGETS[n]], (case, n, own)


@pytest.mark.parametrize("extra", [{}, {"use_cache": False}, {"cache_implementation": "static"}],
                         ids=["eager", "no-cache", "static"])
@pytest.mark.parametrize("case", ["block_diffusion", "fast_dllm_v2_separate_writes", "simsd", "deer"])
def test_a_long_prompt_joins_rows_that_stored_nothing_yet(case, extra):
    """The running rows' prompts are shorter than a block (nothing in the cache yet: its layers are still empty);
    a longer prompt joins (its prefill is wider than everything stored): every row still gets its batch-1 tokens."""
    results: dict = {}
    initial = _requests([1, 3], results)                      # 2 and 1 tokens
    feed = ScriptedFeed(initial, {2: _requests([2, 0], results)})
    ids = torch.tensor([PROMPTS[1], [PAD] + PROMPTS[3]])
    _call(case, ids, (ids != PAD).long(), 12, row_feed=feed, **extra)
    for n in (0, 1, 2, 3):
        assert results[n][0] == _alone(case, n, **extra), (case, n)


def test_per_row_processors_in_a_compiled_step_give_the_eager_scores():
    """`RowProcessors` inside a compiled function (fullgraph): every group's processors on all rows, each row keeps
    its own group's scores, padding rows after the batch; the scores are the eager per-row ones. The graph depends
    on the groups, not on which row has which: rows that change places reuse it; a new group changes the key."""
    from transformers import LogitsProcessorList

    from hf_dllm_spec.maths.sampling import (RowProcessors, Sampler, processors_key, row_processors,
                                             step_processors)

    call = LogitsProcessorList()
    lists = [row_processors(call, temperature=0.7), row_processors(call, temperature=1.3, top_p=0.9),
             row_processors(call, top_k=5)]
    per_row = RowProcessors([lists[0], lists[1], lists[2], lists[1]])
    sampler = Sampler(per_row, do_sample=True, suppress_token_ids=[3])
    assert step_processors(per_row)
    logits = torch.randn(4, 3, 16, generator=torch.Generator().manual_seed(0))
    eager = sampler.scores(logits)
    compiled = torch.compile(lambda x: sampler.scores(x), fullgraph=True, backend="eager")

    def bucket(rows):                                                       # a rows bucket of 8, padding last
        return torch.cat([rows, torch.zeros(8 - rows.shape[0], 3, 16)])

    assert torch.equal(compiled(bucket(logits))[:4], eager)
    assert torch.equal(sampler.scores(bucket(logits))[:4], eager)           # a step run eagerly at its bucket
    key = processors_key(per_row)
    per_row.select(torch.tensor([3, 0, 2]))                                 # rows leave and change places
    assert processors_key(per_row) == key
    assert torch.equal(compiled(bucket(logits[[3, 0, 2]]))[:3], sampler.scores(logits[[3, 0, 2]]))
    per_row.extend([row_processors(call, temperature=0.5)])                 # a row joins with new settings
    assert processors_key(per_row) != key and len(per_row.groups) == 4
    assert torch.equal(compiled(bucket(logits[[3, 0, 2, 1]]))[:4], sampler.scores(logits[[3, 0, 2, 1]]))


@pytest.mark.parametrize("case", fast_first(["block_diffusion", "fast_dllm_v2", "s2d2"]))
@pytest.mark.parametrize("runtime", ["compiled", "captured"])
@pytest.mark.parametrize("initial_rows", [2, 3], ids=["joiners-grow-the-buffers", "joiner-fits"])
def test_own_sampling_settings_in_compiled_steps(case, runtime, initial_rows, request, as_users_run_it):
    """Static runtime with `compile_config` (compiled steps), or in its CUDA-graph mode (captured steps; stood in
    for on the CPU, `replayed_graphs`): a sampled continuous batch whose rows (initial and joining) have their own
    temperature / top-k / top-p runs its steps compiled or captured (per-row processors traced, `RowProcessors`,
    the rows' groups a graph input), and every row's tokens equal the eager runtime's from the same seeds. A row
    whose settings no row had joins into buffers that need not grow (3 rows in 4): the steps' key changes with it
    (before, block diffusion kept the call's first key, and the joiner replayed a graph without its warpers)."""
    from conftest import cpu_compile_config

    if runtime == "captured":
        request.getfixturevalue("replayed_graphs")
    settings = [dict(temperature=0.7), dict(temperature=1.3, top_p=0.9), dict(top_k=5), dict(temperature=0.3, top_k=3)]
    seeds = [31, 32, 33, 34]

    def run(**extra) -> dict:
        results: dict = {}

        def row(n):
            return RowRequest(PROMPTS[n], BUDGETS[n], generator=torch.Generator().manual_seed(seeds[n]),
                              on_done=lambda tokens, reason, stats: results.__setitem__(n, tokens), **settings[n])

        initial = [row(n) for n in range(initial_rows)]
        feed = ScriptedFeed(initial, {2: [row(n) for n in range(initial_rows, 4)]})
        width = max(len(PROMPTS[n]) for n in range(initial_rows))
        ids = torch.tensor([[PAD] * (width - len(PROMPTS[n])) + PROMPTS[n] for n in range(initial_rows)])
        _call(case, ids, (ids != PAD).long(), 12, row_feed=feed, do_sample=True, temperature=0.9,
              generator=[r.generator for r in initial], **extra)
        return results

    model = MODELS[CASES[case][0]]
    hf_dllm_spec.clear_static_state(model)
    eager = run()
    for _ in range(2):                          # the second call replays the first call's graphs
        fast = run(cache_implementation="static",
                   **({"compile_config": cpu_compile_config()} if runtime == "compiled" else {}))
        assert sorted(eager) == [0, 1, 2, 3] and fast == eager
    states = hf_dllm_spec.runtime.static.static_states(model)
    steps = [key for state in states for key in (state.steps.keys if runtime == "compiled" else state.graphs.graphs)
             if key[0] not in ("forward",) and (runtime == "compiled" or key[0] == "step")]
    assert steps, "no decoding step was compiled or captured"
    hf_dllm_spec.clear_static_state(model)


@pytest.mark.parametrize("case", ["block_diffusion", "s2d2", "deer"])
def test_a_joiner_longer_than_the_running_rows_widens_the_attended_prefix(case, replayed_graphs, as_users_run_it,
                                                                          monkeypatch):
    """Captured steps (stood in for on the CPU) with a small length granule: a 9-token prompt joins rows that stored
    fewer tokens, at the first join point; the columns every forward attends over must grow to hold it (a prefix
    sized for the running rows alone would hide the joiner's own tokens from it): every row gets its batch-1
    tokens."""
    import hf_dllm_spec.runtime.static as static_runtime

    monkeypatch.setattr(static_runtime, "LENGTH_GRANULE", 8)
    model = MODELS[CASES[case][0]]
    hf_dllm_spec.clear_static_state(model)
    results, _ = _continuous(case, {1: [2], 3: [4]}, cache_implementation="static")
    for n in (0, 1, 2, 4):
        assert results[n][0] == _alone(case, n), (case, n)
    hf_dllm_spec.clear_static_state(model)


@pytest.mark.parametrize("case", fast_first(list(CASES)))
def test_captured_steps_take_joining_rows(case, replayed_graphs, as_users_run_it):
    """The static runtime's CUDA-graph mode (stood in for on the CPU) with rows joining mid-flight, more than the
    buffers were made for (they double: the graphs go and are captured again): every row gets its batch-1 tokens,
    and decoding steps were captured."""
    model = MODELS[CASES[case][0]]
    hf_dllm_spec.clear_static_state(model)
    results, _ = _continuous(case, {2: [2, 3, 4]}, cache_implementation="static")
    for n in range(5):
        assert results[n][0] == _alone(case, n), (case, n)
    states = hf_dllm_spec.runtime.static.static_states(model)
    assert any(key[0] == "step" for state in states for key in state.graphs.graphs), "no step was captured"
    hf_dllm_spec.clear_static_state(model)


def test_feed_admission_streams_reports_and_times_each_row_alone():
    """`FeedAdmission` without a model: a cancelled row streams nothing more (its client is gone; tokens were still
    sent), a row that ignores EOS ends by length on a stop id, each row's `on_done` gets a copy of its own counters,
    a row that joined is timed from when it joined (it was timed from the call's start), and a row that ended before
    its client left is not "cancelled"."""
    from hf_dllm_spec.integration.rows import FeedAdmission, RowFeed
    from hf_dllm_spec.outputs import SpecDecodingStats

    class Feed(RowFeed):
        def __init__(self, initial, later):
            super().__init__(initial)
            self.later = later

        def take(self, rows):
            out, self.later = self.later, []
            return out

    class Strategy:                          # the class flags FeedAdmission reads
        name, per_row_stops, per_row_sampling = "fake", True, False

    stop, got = 2, {}

    def request(n, budget, **kwargs):
        return RowRequest([5, 6], budget, on_tokens=lambda ids: got.setdefault(("tokens", n), []).append(ids),
                          on_done=lambda tokens, reason, stats: got.__setitem__(("done", n), (tokens, reason, stats)),
                          **kwargs)

    stats = [SpecDecodingStats() for _ in range(3)]
    first, second, joiner = request(0, 3, ignore_eos=True), request(1, 5), request(2, 4)
    admission = FeedAdmission(Feed([first, second], [joiner]), [stop], lambda ids, budget: None,
                              lambda i: stats[i], Strategy, do_sample=False)
    time.sleep(1.0)
    admission.take(2)                                         # the joiner comes a second after the call started
    for s in stats:
        s.num_committed_tokens = 4
    assert admission.stop_check(0, None, [1, 3, stop, 9]) is True
    admission.stop_check(1, None, [4])
    second.cancelled.set()
    admission.stop_check(1, None, [4, 8])
    assert admission.cancelled(1)
    admission.left(0)
    admission.left(1)
    admission.stop_check(2, None, [7, stop])
    admission.left(2)
    assert got[("done", 0)][:2] == ([1, 3, stop], "length")
    assert got[("tokens", 1)] == [[4]] and got[("done", 1)][1] == "cancelled"
    assert [got[("done", n)][2].num_generated_tokens for n in range(3)] == [3, 2, 2]
    assert got[("done", 2)][2].wall_time_s < got[("done", 0)][2].wall_time_s - 0.5
    stats[0].num_generated_tokens = 99
    assert got[("done", 0)][2].num_generated_tokens == 3      # a copy: later changes of the call's stats stay out

    ended = request(3, 5)
    admission = FeedAdmission(Feed([ended], []), [stop], lambda ids, budget: None, lambda i: SpecDecodingStats(),
                              Strategy, False)
    admission.stop_check(0, None, [1, stop])
    ended.cancelled.set()
    assert admission.cancelled(0) is False
