"""Property: the static runtime, plain, with each decoding step compiled, and with each step captured in a CUDA
graph (stood in for on the CPU), gives the eager runtime's output on random batches.

The random cases of tests/random_batches.py (every strategy on every family; 1-4 left-padded prompts of 1-10
tokens, random block sizes and budgets, a stop id that ends rows anywhere), greedy or seeded (transformers'
temperature and top-k warpers; one shared generator or one per row): `cache_implementation="static"` and
`cache_implementation="static"` with a `compile_config` (issue 34: each step one `torch.compile(fullgraph=True)`
function; dynamo's "eager" backend, the trace and its guards) give the eager runtime's tokens, per-row counters and
forward calls, and leave the generators in the same state. The compiled steps must have run: a case whose calls all
fell back to eager steps fails.

3 batches per strategy (each compiles its own keys; 4 batches took 14-36 s per strategy in suite runs on 2 cores,
8 batches 22-54 s, which put CI over 30 minutes); all but the first strategy only in the full suite (`slow`).

The captured property (the static runtime's default mode on a GPU, each decoding step one CUDA graph) runs on the
CPU with a tape that records each capture's operations and replays them without the Python (`replayed_graphs`,
tests/graph_tape.py): 8 batches per strategy, about 0.5 s each on one core (200 per strategy, 2,000 in all, passed
when this test was written).
"""

from __future__ import annotations

import functools

import pytest
from conftest import assert_same_decode, cpu_compile_config, fast_first, generator_states, seeded
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from random_batches import CASES, assume_it_fits, batches, check_or_tie, generate, left_padded, stop_id

from graph_tape import ReplayedGraphs
from hf_dllm_spec.runtime.step import CompiledSteps

pytestmark = pytest.mark.usefixtures("as_users_run_it")

#: Random batches per strategy in the captured property (a tape records and replays every capture: slower).
CAPTURED_EXAMPLES = 5

#: The seeded variants' sampling parameters; their generators are `seeded`'s "shared" (one for the batch) or "rows"
#: (one per row).
SAMPLING = {"do_sample": True, "temperature": 1.5, "top_k": 20}


class StepCalls:
    """Counts the compiled decoding steps run (`CompiledSteps.run`, not the plain compiled forwards)."""

    def __init__(self, monkeypatch) -> None:
        self.count = 0
        run = CompiledSteps.run

        def counted(steps, key, *args):
            self.count += key[0] != "forward"
            return run(steps, key, *args)

        monkeypatch.setattr(CompiledSteps, "run", counted)


#: The runtimes each case runs besides the eager one: static, and static with every decoding step compiled.
STATIC_AND_COMPILED = ({"cache_implementation": "static"},
                       {"cache_implementation": "static", "compile_config": cpu_compile_config()})


def _check(name: str, case, models: dict, runtimes: tuple = STATIC_AND_COMPILED) -> None:
    (prompts, params, budget, stop), kind = case
    if kind is not None:
        params = {**params, **SAMPLING}
    assume_it_fits(name, prompts, params, budget)
    eos = stop_id(name, (prompts, params, budget, stop), models, **seeded({"generator": kind and "shared"}, 1))
    ids, mask = left_padded(prompts)
    outputs, after = [], []
    for options in ({}, *runtimes):
        generator = seeded({"generator": kind}, len(prompts))["generator"]
        outputs.append(generate(name, ids, mask, params, budget, eos, models, generator=generator,
                                return_dict_in_generate=True, **options))
        after.append(generator_states(generator))
    for output, state in zip(outputs[1:], after[1:]):
        assert_same_decode(outputs[0], output)
        assert state == after[0]


def _property(name: str, examples: int, runtimes: tuple = STATIC_AND_COMPILED) -> None:
    @settings(max_examples=examples, deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much])
    @given(case=st.tuples(batches(name), st.sampled_from([None, "shared", "rows"])))
    def run(case):
        check_or_tie(functools.partial(_check, runtimes=runtimes), name, case)

    run()


@pytest.mark.parametrize("name", fast_first(list(CASES)))
def test_static_and_compiled_equal_eager(name, monkeypatch):
    calls = StepCalls(monkeypatch)
    _property(name, 3)
    assert calls.count > 0, f"{name}: no compiled decoding step ran"


@pytest.mark.parametrize("name", fast_first(list(CASES)))
def test_captured_equals_eager(name, replayed_graphs):
    """The static runtime's CUDA-graph mode, each decoding step captured as one graph (stood in for on the CPU by a
    tape replayed without the Python, `replayed_graphs`), on the same random cases: the eager runtime's output
    and generator states. Steps must have been captured."""
    _property(name, CAPTURED_EXAMPLES, runtimes=({"cache_implementation": "static"},))
    assert ReplayedGraphs.step_captures > 0, f"{name}: no decoding step was captured"
