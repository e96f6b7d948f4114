"""The static runtime (`cache_implementation="static"`) gives the eager runtime's tokens and forward counts.

Every strategy on every bundled model (drafter pairs, sub-blocks, LLaDA2.1 editing), a left-padded batch, greedy and
seeded sampling, two calls that reuse the model's static state, and a cache / query width that overflows its
bucket; plus the runner itself against the eager `ModelRunner` on logits. CPU: no CUDA graphs (transformers compiles
only on accelerators); one slow test compiles a tiny model's forward with `compile_config` on the CPU, and the
CUDA-graph path runs with capture and replay stood in for by re-running the forward on the static buffers
(`ReplayedGraphs`). Host synchronisations are counted: none inside any forward, one per forward in the loop.
"""

from __future__ import annotations

import copy
import gc
import logging
import random
import shutil
import threading
from dataclasses import fields
from types import SimpleNamespace

import pytest
import torch
from transformers import CompileConfig, DynamicCache, GenerationConfig

from conftest import Recorder, cpu_compile_config, fast_first, generator_states, no_cyclic_garbage
from graph_tape import GUARD, ReplayedGraphs
import hf_dllm_spec
import hf_dllm_spec.integration.plan as plan_module
import hf_dllm_spec.runtime.graphs as graphs_runtime
import hf_dllm_spec.runtime.static as static_runtime
import model_patches
from model_patches.compat import CACHE_KWARG
from hf_dllm_spec.tools.cost_model import check_gpu
from hf_dllm_spec.tools.jobs.evaluation import ROOT, arithmetic_prompts, load
from hf_dllm_spec.tools.jobs.main import SUB_BLOCKS, specs
from hf_dllm_spec.maths.masks import causal_mask
from hf_dllm_spec.outputs import BatchStats
from hf_dllm_spec.runtime.runner import ModelRunner
from hf_dllm_spec.runtime.static import (StaticModelRunner, clear_static_state, compile_plan,
                                         static_states, width_bucket)
from hf_dllm_spec.runtime.step import compile_options
from hf_dllm_spec.runtime.syncs import count_host_syncs

MODELS = ROOT / "models"
MAX_NEW_TOKENS = 8
#: model -> (strategy rows of the main job on it, drafter): every strategy, every family (check-gpu's table).
CASES = check_gpu.CASES
TIMES = {"wall_time_s", "prefill_time_s", "forward_time_s", "draft_model_time_s", "warmup_time_s", "runtime"}


def counters(stats) -> dict:
    return {f.name: getattr(stats, f.name) for f in fields(stats) if f.name not in TIMES}


@pytest.fixture(scope="module")
def bundled():
    """name -> (tokenizer, model), loaded once."""
    return {name: load(MODELS / name) for name in {*CASES, "deer-drafter-tiny"}}


def _generate(model, tokenizer, texts, spec, **kwargs):
    """check-gpu's call (a left-padded batch on the model's device, through its entry point), MAX_NEW_TOKENS new
    tokens unless given."""
    return check_gpu._generate(model, tokenizer, texts, spec, kwargs.pop("max_new_tokens", MAX_NEW_TOKENS), **kwargs)


def _assert_same(eager, static, label):
    assert static.sequences.tolist() == eager.sequences.tolist(), f"{label}: tokens differ"
    for n, (a, b) in enumerate(zip(eager.spec_stats_per_row, static.spec_stats_per_row)):
        assert counters(b) == counters(a), f"{label}: row {n} counters (NFE) differ"
    assert static.spec_stats.num_forward_calls == eager.spec_stats.num_forward_calls


def _spec(bundled, name, strategy):
    """The main job's row `strategy` for bundled model `name` (its drafter, its family's sub-blocks)."""
    drafter_name = CASES[name][1]
    tokenizer, model = bundled[name]
    return tokenizer, model, check_gpu._spec(model, strategy, bundled[drafter_name][1] if drafter_name else None)


def _texts(name, n=2):
    return [p.text for p in arithmetic_prompts(MODELS / name, n)]


@pytest.mark.parametrize("name,strategy", [(name, s) for name, (rows, _) in CASES.items() for s in rows])
def test_static_runtime_equals_eager_on_bundled_models(name, strategy, bundled, one_thread):
    """Every strategy row of every bundled model, a left-padded batch of 2, greedy: same tokens, same counters; the
    calls leave nothing in reference cycles."""
    tokenizer, model, spec = _spec(bundled, name, strategy)
    texts = _texts(name)
    with no_cyclic_garbage(f"{name} / {spec.label}"):
        eager = _generate(model, tokenizer, texts, spec)
        static = _generate(model, tokenizer, texts, spec, cache_implementation="static")
    _assert_same(eager, static, f"{name} / {spec.label}")
    if spec.draft_model is not None:
        assert static_states(spec.draft_model)                   # the drafter ran on its own static runtime


def test_second_call_reuses_the_static_state(bundled, one_thread):
    """Two calls in a row (a different batch in between): the cache object persists on the model, tokens stay."""
    tokenizer, model, spec = _spec(bundled, "sdar-tiny-arith", "s2d2")
    texts = _texts("sdar-tiny-arith", 3)
    clear_static_state(model)
    eager = _generate(model, tokenizer, texts[:2], spec)
    first = _generate(model, tokenizer, texts[:2], spec, cache_implementation="static")
    (state,) = static_states(model)
    _generate(model, tokenizer, texts[2:], spec, cache_implementation="static")         # batch 1: same state
    second = _generate(model, tokenizer, texts[:2], spec, cache_implementation="static")
    _assert_same(eager, first, "first call")
    _assert_same(eager, second, "second call")
    assert static_states(model) == [state]


@pytest.mark.parametrize("name,strategy", [("sdar-tiny-arith", "s2d2"), ("fast-dllm-v2-tiny", "fast_dllm_v2"),
                                           ("llada2-tiny", "llada2"), ("qwen2-tiny-ar", "deer"),
                                           ("sdar-large", "simsd")])
def test_static_runtime_equals_eager_with_seeded_sampling(name, strategy, bundled, one_thread):
    tokenizer, model, spec = _spec(bundled, name, strategy)
    texts = _texts(name)
    sample = dict(do_sample=True, temperature=1.0, top_k=0)
    with no_cyclic_garbage(f"{name} / {spec.label}, sampled"):
        eager = _generate(model, tokenizer, texts, spec, generator=torch.Generator().manual_seed(3), **sample)
        static = _generate(model, tokenizer, texts, spec, generator=torch.Generator().manual_seed(3), **sample,
                           cache_implementation="static")
    _assert_same(eager, static, f"{name} / {spec.label}, sampled")


def test_a_dropped_static_cache_is_freed_at_once(bundled, one_thread):
    """A static state that is cleared (or replaced by a larger one) frees its cache's buffers at once: no layer
    refers back to its cache (such a cycle kept the device memory until Python's cyclic collector ran)."""
    tokenizer, model, spec = _spec(bundled, "sdar-tiny-arith", "ar")
    clear_static_state(model)
    with no_cyclic_garbage("a static call, then its state cleared"):
        _generate(model, tokenizer, _texts("sdar-tiny-arith"), spec, cache_implementation="static")
        clear_static_state(model)


def test_overflowing_cache_and_width_buckets(bundled, monkeypatch, one_thread):
    """A cache allocated far too short grows (several times) mid-call, and widths above a small granule go to its
    multiples: tokens and counts stay the eager ones."""
    tokenizer, model = bundled["sdar-tiny-arith"]
    monkeypatch.setattr(plan_module, "static_cache_length", lambda *args: 1)
    monkeypatch.setattr(static_runtime, "WIDTH_GRANULE", 8)
    monkeypatch.setattr(static_runtime, "LENGTH_GRANULE", 8)
    assert [width_bucket(w) for w in (1, 3, 8, 9, 16, 17)] == [1, 4, 8, 16, 16, 24]
    clear_static_state(model)
    texts = _texts("sdar-tiny-arith")
    for spec in specs(4, 0.9, ["dynamic", "s2d2"], {}):
        eager = _generate(model, tokenizer, texts, spec)
        static = _generate(model, tokenizer, texts, spec, cache_implementation="static")
        _assert_same(eager, static, f"overflow / {spec.label}")
    (state,) = static_states(model)  # grown, kept
    assert state.cache.max_cache_len >= max(len(tokenizer(t).input_ids) for t in texts) + MAX_NEW_TOKENS


@pytest.mark.parametrize("grows", [False, True], ids=["prefix-grows", "cache-grows"])
@pytest.mark.parametrize("steps", [True, False], ids=["whole-steps", "forwards-only"])
def test_captured_graphs_follow_a_growing_prefix_and_cache(bundled, monkeypatch, replayed_graphs, as_users_run_it,
                                                           grows, steps):
    """Captured (stood in for on the CPU), with a small length granule the attended prefix doubles several times in a
    call (8, 16, 32, 64), and with a cache allocated far too short the cache grows mid-call: a graph kept across
    either would attend to too few columns or read the old buffers. Whole steps captured (greedy) or forwards only
    (`eta_cutoff`, whose steps run eagerly): the eager tokens and counters, in the call that captures and the next."""
    tokenizer, model, spec = _spec(bundled, "sdar-tiny-arith", "s2d2")
    monkeypatch.setattr(static_runtime, "LENGTH_GRANULE", 8)
    if grows:
        monkeypatch.setattr(plan_module, "static_cache_length", lambda *args: 1)
    clear_static_state(model)
    texts = _texts("sdar-tiny-arith")
    options = {} if steps else dict(do_sample=True, eta_cutoff=1e-3)

    def run(cache):
        extra = {} if steps else {"generator": [torch.Generator().manual_seed(9 + i) for i in range(len(texts))]}
        return _generate(model, tokenizer, texts, spec, cache_implementation=cache, max_new_tokens=40, **options,
                         eos_token_id=None, pad_token_id=0, **extra)                  # 32 + 40 columns: past 64

    eager = run(None)
    for label in ("captured", "replayed"):
        _assert_same(eager, run("static"), f"{label}")
    (state,) = static_states(model)
    assert bool(_step_graphs([state])) == steps and state.graphs.captures
    clear_static_state(model)


def test_max_cache_len_sizes_the_cache_for_the_calls_to_come(bundled, one_thread):
    """transformers' `max_cache_len` (the static cache sized once for the calls to come) sizes the kept cache on the
    first call; tokens and counters stay the eager ones."""
    tokenizer, model, spec = _spec(bundled, "sdar-tiny-arith", "s2d2")
    clear_static_state(model)
    texts = _texts("sdar-tiny-arith")
    eager = _generate(model, tokenizer, texts, spec)
    static = _generate(model, tokenizer, texts, spec, cache_implementation="static", max_cache_len=700)
    _assert_same(eager, static, "max_cache_len")
    (state,) = static_states(model)
    assert state.cache.max_cache_len >= 700
    clear_static_state(model)


def test_runner_logits_equal_eager_runner(sdar_model):
    """The runner alone, against the eager runner: left-padded stored segments, read-only queries, a discarded tail
    and a row selection give the same logits; read-only tokens never become visible."""
    patch = model_patches.get_patch(sdar_model)
    torch.manual_seed(0)
    eager = ModelRunner(sdar_model, patch, BatchStats(3), batch_size=3)
    static = StaticModelRunner(sdar_model, patch, BatchStats(3), batch_size=3, max_cache_len=8)   # grows
    ids = torch.randint(0, 90, (3, 6))
    pos = torch.arange(6).expand(3, 6)
    valid = torch.tensor([[1, 1, 1, 1, 1, 1], [0, 0, 1, 1, 1, 1], [0, 0, 0, 0, 1, 1]], dtype=torch.bool)
    steps = [
        dict(input_ids=ids, position_ids=pos, intra_mask=causal_mask(6), kind="prefill", store_len=6,
             store_valid=valid),
        dict(input_ids=torch.randint(0, 90, (3, 8)), position_ids=torch.arange(6, 14).expand(3, 8),   # read-only
             intra_mask=torch.ones(8, 8, dtype=torch.bool), kind="draft"),
        dict(input_ids=torch.randint(0, 90, (3, 5)), position_ids=torch.arange(6, 11).expand(3, 5),   # store 3 + 2 ro
             intra_mask=causal_mask(5), kind="verify", store_len=3, logits_to_keep=2),
    ]
    for step in steps:
        torch.testing.assert_close(static.forward(**step), eager.forward(**step), rtol=1e-5, atol=1e-5)
    discard = torch.tensor([1, 0, 2])
    eager.discard_tail(discard)
    static.discard_tail(discard)
    assert static.lengths.tolist() == [8, 7, 3]
    index = torch.tensor([2, 0])
    eager.select_rows(index)
    static.select_rows(index)
    step = dict(input_ids=torch.randint(0, 90, (2, 4)), position_ids=torch.tensor([[7, 8, 9, 10], [8, 9, 10, 11]]),
                intra_mask=causal_mask(4), kind="draft", store_len=4)
    torch.testing.assert_close(static.forward(**step), eager.forward(**step), rtol=1e-5, atol=1e-5)
    assert static.batch_size == 2 and static.lengths.tolist() == [7, 12]


def test_right_shift_runner_needs_a_carry_to_discard(bundled):
    _, model = bundled["qwen2-tiny-ar"]
    runner = StaticModelRunner(model, model_patches.get_patch(model), BatchStats(1), batch_size=1, max_cache_len=8)
    with pytest.raises(ValueError, match="needs `carry`"):
        runner.discard_tail(torch.tensor([1]))


def test_compile_plan_follows_transformers(sdar_model, monkeypatch):
    assert compile_plan(sdar_model, GenerationConfig(cache_implementation="static"))[0] == "eager"   # CPU
    assert compile_plan(sdar_model, GenerationConfig(disable_compile=True)) == ("eager", "disable_compile=True")
    config = CompileConfig()
    config._compile_all_devices = True
    assert compile_plan(sdar_model, GenerationConfig(compile_config=config)) == ("compile", "")
    monkeypatch.setattr(sdar_model, "hf_quantizer", SimpleNamespace(is_compileable=False), raising=False)
    mode, reason = compile_plan(sdar_model, GenerationConfig(compile_config=config))   # bitsandbytes, as transformers
    assert mode == "eager" and "cannot be compiled" in reason


@pytest.mark.parametrize("kwargs,name,exc", [
    (dict(cache_implementation="static", use_cache=False), "use_cache", ValueError),
    (dict(cache_implementation="offloaded"), "cache_implementation", ValueError),
    (dict(cache_implementation="static", **{CACHE_KWARG: DynamicCache()}), "cache", ValueError),
])
def test_unsupported_static_configurations_are_refused(sdar_model, monkeypatch, kwargs, name, exc):
    monkeypatch.setattr(sdar_model, "forward", lambda *a, **k: (_ for _ in ()).throw(AssertionError("forward")))
    with pytest.raises(exc, match=name):
        sdar_model.generate(torch.tensor([[1, 2, 3]]), decoding_strategy="block_diffusion", max_new_tokens=4,
                            eos_token_id=None, **kwargs)


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("cc") is None,
                    reason="torch.compile (inductor) needs a C++ compiler on the CPU")
def test_compiled_forward_gives_the_eager_tokens(sdar_model, one_thread):
    """`compile_config` with `_compile_all_devices` compiles the forward on the CPU (transformers' meaning); the
    tokens are the eager runtime's."""
    config = CompileConfig(fullgraph=False, mode="default")
    config._compile_all_devices = True
    prompt = torch.tensor([[5, 17, 42, 8]])
    common = dict(decoding_strategy="block_diffusion", block_size=4, max_new_tokens=4, eos_token_id=None)
    eager = sdar_model.generate(prompt, **common)
    compiled = sdar_model.generate(prompt, cache_implementation="static", compile_config=config, **common)
    assert compiled.tolist() == eager.tolist()
    steps = static_runtime.static_states(sdar_model)[0].steps
    assert any(key[0] == "forward" for key in steps.keys)                   # the runtime's compiled forwards ran


def test_compiled_forwards_do_not_share_dynamo_recompile_limit(sdar_model):
    """Each fixed-shape forward is compiled as its own code object: with dynamo's recompile limit at 1, two
    prompt widths (different forward shapes) still run one compiled graph each, none falls back to eager (with
    transformers' `get_compiled_call`, one code object for every model, the second shape would have run eagerly),
    and the tokens are the eager runtime's."""
    clear_static_state(sdar_model)
    common = dict(decoding_strategy="ar", max_new_tokens=3, eos_token_id=None)
    with torch._dynamo.config.patch(recompile_limit=1):     # (pytest's monkeypatch breaks dynamo's config module)
        for prompt in (torch.tensor([[5, 17, 42, 8]]), torch.tensor([[5, 17, 42, 8, 23, 61, 4, 9, 11, 3]])):
            eager = sdar_model.generate(prompt, **common)
            compiled = sdar_model.generate(prompt, cache_implementation="static",
                                           compile_config=cpu_compile_config(), **common)
            assert compiled.tolist() == eager.tolist()
    steps = static_runtime.static_states(sdar_model)[0].steps
    forwards = [key for key in steps.keys if key[0] == "forward"]
    assert len({key[3] for key in forwards}) >= 2, forwards                 # two widths at least
    assert all(steps.graphs(key) == 1 for key in steps.keys), [(key, steps.graphs(key)) for key in steps.keys]
    clear_static_state(sdar_model)


def test_another_compile_config_compiles_its_own_functions(sdar_model, monkeypatch):
    """Compiled forwards and steps are kept on the model across calls, per compile options: a later call with
    another `compile_config` (here another backend) compiles its own instead of running the first call's."""
    monkeypatch.setattr(ModelRunner, "check_layouts", False)       # as users run it (the checks read the device)
    clear_static_state(sdar_model)
    prompt, common = torch.tensor([[5, 17, 42, 8]]), dict(decoding_strategy="ar", max_new_tokens=3,
                                                          eos_token_id=None, cache_implementation="static")
    eager = sdar_model.generate(prompt, decoding_strategy="ar", max_new_tokens=3, eos_token_id=None)
    for backend in ("eager", "eager", "aot_eager"):
        out = sdar_model.generate(prompt, compile_config=cpu_compile_config(backend), **common)
        assert out.tolist() == eager.tolist()
    keys = static_runtime.static_states(sdar_model)[0].steps.keys
    options = {repr(sorted(compile_options(cpu_compile_config(backend), fullgraph=False).items()))
               for backend in ("eager", "aot_eager")}
    assert {next(part for part in key if part in options) for key in keys} == options, keys
    clear_static_state(sdar_model)


#: (bundled model, main-job row, sampled): every strategy x family whose step compiles (issue 34).
COMPILED_STEP_ROWS = [("sdar-tiny-arith", "ar", False), ("sdar-tiny-arith", "dynamic", False),
                      ("sdar-tiny-arith", "dynamic", True), ("sdar-tiny-arith", "s2d2", False),
                      ("fast-dllm-v2-tiny", "fast_dllm_v2", False), ("fast-dllm-v2-tiny", "s2d2", False),
                      ("sdar-tiny-arith", "s2d2", True), ("llada2-tiny", "llada2", False),
                      ("sdar-large", "simsd", False), ("sdar-large", "simsd", True), ("qwen2-tiny-ar", "deer", False),
                      ("qwen2-tiny-ar", "deer", True)]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
@pytest.mark.parametrize("runtime", ["captured", "compiled"])
@pytest.mark.parametrize("name,row,sampled", COMPILED_STEP_ROWS)
def test_steps_on_cuda_graphs_give_the_eager_tokens(name, row, sampled, runtime, monkeypatch):
    """On a GPU, every decoding step (SimSD and DEER: every cycle's functions) replayed as a CUDA graph: captured
    whole by the static runtime itself ("captured": `cache_implementation="static"`, the default on a GPU), or
    compiled by `compile_config` in "reduce-overhead" mode ("compiled": inductor's CUDA graphs). Tokens and
    counters equal the eager runtime's, greedy and seeded (a CUDA `torch.Generator`: the noise drawn before the
    step equals `torch.multinomial`'s draw), on a left-padded batch of 2, in the call that captures and in later
    ones; a third call captures or compiles no new step (a call's first forward runs its step eagerly, so the
    second call may add that one). Fresh copies of the bundled models (the session's CPU ones stay where they are)."""
    monkeypatch.setattr(ModelRunner, "check_layouts", False)       # as users run it (the checks read the device)
    drafter_name = CASES[name][1]
    models = {n: (tokenizer, model.to("cuda")) for n in filter(None, (name, drafter_name))
              for tokenizer, model in [load(MODELS / n)]}
    tokenizer, model, spec = _spec(models, name, row)
    texts = _texts(name)
    config = {"compile_config": CompileConfig(mode="reduce-overhead")} if runtime == "compiled" else {}
    sample = (lambda: dict(do_sample=True, temperature=1.0, top_k=20,
                           generator=torch.Generator("cuda").manual_seed(3))) if sampled else dict

    def step_keys():
        states = _states(model, spec)
        if runtime == "compiled":
            return [key for state in states for key in state.steps.keys if key[0] != "forward"]
        assert all(state.graphs.failure is None for state in states), [state.graphs.failure for state in states]
        return [key for state in states for key in state.graphs.graphs if key[0] == "step"]

    eager = _generate(model, tokenizer, texts, spec, max_new_tokens=16, **sample())
    keys = []
    for call in range(3):
        fast = _generate(model, tokenizer, texts, spec, max_new_tokens=16, cache_implementation="static",
                         **config, **sample())
        _assert_same(eager, fast, f"{spec.label} sampled={sampled}, {runtime} step, call {call + 1}")
        assert step_keys(), f"no decoding step was {runtime}"
        if call == 1:
            keys = step_keys()
    assert step_keys() == keys


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
@pytest.mark.parametrize("name,strategies", [("sdar-tiny-arith", ["ar", "dynamic", "s2d2"]),
                                             ("fast-dllm-v2-tiny", ["fast_dllm_v2", "s2d2"]),
                                             ("llada2-tiny", ["llada2"]), ("sdar-large", ["simsd"]),
                                             ("qwen2-tiny-ar", ["deer"])])
def test_cuda_graphs_replay_the_eager_tokens(name, strategies):
    """On a GPU: replayed graphs give the eager tokens and counts; every forward is captured (none falls back);
    later calls capture nothing new; memory stays flat over 50 calls (as check-gpu's memory check)."""
    tokenizer, model = load(MODELS / name)
    model.to("cuda")
    drafter_name = CASES[name][1]
    drafter = load(MODELS / drafter_name)[1].to("cuda") if drafter_name else None
    patch = model_patches.get_patch(model)
    family = SUB_BLOCKS if patch.native_strategy == "fast_dllm_v2" else None
    texts = _texts(name)
    for spec in specs(patch.trained_block_size(model) or 4, 0.9, strategies, {}, family, drafter, draft_block_size=8):
        eager = _generate(model, tokenizer, texts, spec)
        static = _generate(model, tokenizer, texts, spec, cache_implementation="static")
        _assert_same(eager, static, f"{name} / {spec.label}, CUDA graphs")
        states = [*static_states(model), *(static_states(spec.draft_model) if spec.draft_model is not None else [])]
        # every forward is free of host syncs (test_forwards_are_sync_free_and_steps_sync_little): all captured
        assert all(state.graphs.captures > 0 and state.graphs.failure is None for state in states), \
            [state.graphs.failure for state in states]
        assert "eager" not in static.spec_stats.runtime and "cuda_graph" in static.spec_stats.runtime
        captures = [state.graphs.captures for state in states]
        memory = []
        for call in range(50):
            again = _generate(model, tokenizer, texts, spec, cache_implementation="static")
            if call % 10 == 0:
                _assert_same(eager, again, f"{name} / {spec.label}, replayed")
            gc.collect()                    # what is still reachable, not when Python's collector last ran
            torch.cuda.synchronize()
            memory.append(torch.cuda.memory_allocated())
        assert [state.graphs.captures for state in states] == captures, "a graph was captured twice"
        assert memory[-1] == memory[1], f"memory grows over calls: {memory}"


def test_stats_name_the_runtime_and_its_warmup(sdar_model, prompt):
    """`spec_stats.runtime` says which runtime ran each model; eager by default, the static cache when asked."""
    eager = sdar_model.generate(prompt, decoding_strategy="block_diffusion", max_new_tokens=8, eos_token_id=None,
                                return_dict_in_generate=True)
    static = sdar_model.generate(prompt, decoding_strategy="block_diffusion", max_new_tokens=8, eos_token_id=None,
                                 return_dict_in_generate=True, cache_implementation="static")
    assert eager.spec_stats.runtime == "target: eager"
    assert static.spec_stats.runtime.startswith("target: static cache")
    assert static.spec_stats.warmup_time_s == 0.0            # nothing is captured or compiled on the CPU
    assert torch.equal(eager.sequences, static.sequences)


@pytest.mark.parametrize("strategy", ["block_diffusion", "s2d2"])
def test_autocast_and_plain_calls_share_a_model(sdar_model, prompt, strategy):
    """A call under `torch.autocast` and a plain one, in either order, each give the eager runtime's tokens under
    the same setting: autocast changes the dtype of the K/V, so each keeps its own static state (the second one
    failed in the cache's `scatter_` until `clear_static_state`)."""
    kwargs = dict(decoding_strategy=strategy, block_size=4, max_new_tokens=8, eos_token_id=None)

    def run(autocast: bool, **more):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            return sdar_model.generate(prompt, **kwargs, **more).tolist()

    clear_static_state(sdar_model)
    for autocast in (False, True, False, True):
        assert run(autocast, cache_implementation="static") == run(autocast), autocast
    clear_static_state(sdar_model)


def test_compile_config_that_does_not_compile_is_said_once(sdar_model, prompt, caplog):
    """A `compile_config` on the CPU (transformers compiles on accelerators only) is warned about once per process
    and reason, as transformers' own `warning_once`, not on every call of a loop."""
    from hf_dllm_spec.runtime import static

    static._warn_not_compiled.cache_clear()
    with caplog.at_level(logging.WARNING, logger="hf_dllm_spec.runtime.static"):
        for _ in range(3):
            sdar_model.generate(prompt, decoding_strategy="block_diffusion", max_new_tokens=4, eos_token_id=None,
                                cache_implementation="static", compile_config=CompileConfig())
    said = [r.getMessage() for r in caplog.records if "is not compiled" in r.getMessage()]
    assert said == ["hf_dllm_spec: `compile_config` is set but SDARForCausalLM is not compiled: no compilation on "
                    "cpu (transformers compiles on accelerators, or with `CompileConfig._compile_all_devices`)."]


# -- host synchronisations: none inside a forward (a CUDA graph can capture it), few per decoding step ------------
def test_host_sync_counter_counts_what_makes_the_host_wait():
    t = torch.arange(6)
    with count_host_syncs() as syncs:
        _ = t + 1, t.sum(), t.reshape(2, 3), t[1:3], t[torch.tensor([0, 2])]        # none of these waits
        assert syncs.total == 0
        t.sum().item(), t.tolist(), bool(t.any()), int(t.max()), t[t > 2], t.nonzero()
    assert syncs.total == 6
    assert syncs.by_operation == {"item": 1, "tolist": 1, "__bool__": 1, "__int__": 1, "boolean index": 1,
                                  "nonzero": 1}
    assert set(syncs.by_site) == {("<outside>", 0)}                 # no frame of the library's packages


#: Host synchronisations per decoding forward at batch 1 (the counted syncs between the first decoding forward and
#: the last one, over the forwards in between), as users run it (`check_layouts` off): one read of the step's
#: decisions per forward; SimSD also reads its compact verify width and the drafts' count (1.64 measured).
MAX_SYNCS_PER_FORWARD = {"simsd": 1.7}


@pytest.mark.parametrize("name,strategy", [(name, s) for name, (rows, _) in CASES.items() for s in rows])
def test_forwards_are_sync_free_and_steps_sync_little(name, strategy, bundled, monkeypatch, one_thread):
    """Under the static runtime no forward (target or drafter) reads a device value on the host, so a CUDA graph
    can capture every forward of every strategy and family; and the decoding loop reads the device once per
    forward (`MAX_SYNCS_PER_FORWARD`)."""
    tokenizer, model, spec = _spec(bundled, name, strategy)
    inside, before = [], []                  # per forward: the syncs inside it; all syncs of the call before it
    run = StaticModelRunner._run

    def counted_run(self, *args):
        before.append(syncs.total)
        with count_host_syncs() as inner:
            out = run(self, *args)
        inside.append(inner.by_site)
        return out

    monkeypatch.setattr(StaticModelRunner, "_run", counted_run)
    monkeypatch.setattr(ModelRunner, "check_layouts", False)          # as users run it (the suite turns it on)
    with count_host_syncs() as syncs:
        _generate(model, tokenizer, _texts(name, 1), spec, cache_implementation="static", max_new_tokens=24)
    assert inside and not any(inside), f"{spec.label}: host syncs inside forwards: {[s for s in inside if s]}"
    assert len(before) > 4
    forwards = len(before) - 2                           # from the second forward (after the prefill) to the last
    per_forward = (before[-1] - before[1]) / forwards
    assert per_forward <= MAX_SYNCS_PER_FORWARD.get(spec.decoding_strategy, 1.0), syncs.by_site.most_common(6)


def test_remote_code_llada2_routes_experts_without_host_syncs():
    """Loaded through its checkpoint's remote code (a module that only imports `model_patches`), LLaDA2 still gets
    transformers' "grouped_mm" experts (one fixed-shape kernel per projection), not the "eager" loop over experts
    that synchronises per expert and cannot be captured; its logits equal the eager experts'."""
    from transformers.dynamic_module_utils import get_class_from_dynamic_module

    path = MODELS / "llada2-tiny"
    remote = get_class_from_dynamic_module("modeling_hf_dllm_spec.LLaDA2MoeModelLM", path)
    assert remote.__module__.startswith("transformers_modules")          # the checkpoint's shim, not the library's
    model = remote.from_pretrained(path, dtype=torch.float32)
    assert model.config._experts_implementation == "grouped_mm"
    ids = torch.randint(0, 90, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), count_host_syncs() as syncs:
        grouped = model(ids).logits
    assert syncs.total == 0, syncs.by_site
    model.set_experts_implementation("eager")
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, grouped, rtol=1e-4, atol=1e-4)


# -- the CUDA-graph bookkeeping on the CPU: capture and replay stood in for by a tape (graph_tape.py) ---------
def _states(model, spec) -> list:
    return [*static_states(model), *(static_states(spec.draft_model) if spec.draft_model is not None else [])]


@pytest.mark.parametrize("name,strategy", [("sdar-tiny-arith", "s2d2"), ("fast-dllm-v2-tiny", "fast_dllm_v2"),
                                           ("llada2-tiny", "llada2"), ("sdar-large", "simsd"),
                                           ("qwen2-tiny-ar", "deer")])
def test_graph_bookkeeping_replays_the_eager_tokens(name, strategy, bundled, replayed_graphs, one_thread):
    """The "cuda_graph" path of the static runtime, capture and replay stood in for on the CPU: every forward after
    the first of its shape replays from the static buffers (the inputs copied in, the write columns read from
    their buffer), under the model's device; tokens and counters equal the eager runtime's, and a second call
    captures nothing new."""
    tokenizer, model, spec = _spec(bundled, name, strategy)
    texts = _texts(name)
    for m in (model, spec.draft_model):
        if m is not None:
            clear_static_state(m)
    eager = _generate(model, tokenizer, texts, spec)
    first = _generate(model, tokenizer, texts, spec, cache_implementation="static")
    states = _states(model, spec)
    captures = [state.graphs.captures for state in states]
    second = _generate(model, tokenizer, texts, spec, cache_implementation="static")
    _assert_same(eager, first, f"{name} / {spec.label}, captured")
    _assert_same(eager, second, f"{name} / {spec.label}, replayed")
    assert all(isinstance(state.graphs, ReplayedGraphs) and state.graphs.captures for state in states)
    assert [state.graphs.captures for state in states] == captures, "a graph was captured twice"
    assert "cuda_graph" in first.spec_stats.runtime and first.spec_stats.warmup_time_s > 0


def _step_graphs(states) -> int:
    return sum(key[0] == "step" for state in states for key in state.graphs.graphs)


@pytest.mark.parametrize("name,strategy", fast_first([(name, s) for name, (rows, _) in CASES.items() for s in rows]))
@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded"])
def test_captured_steps_replay_the_eager_tokens(name, strategy, sampled, bundled, replayed_graphs, as_users_run_it):
    """The default static runtime on a GPU ("cuda_graph") captures each decoding step, forward and maths, as one
    graph (`StaticModelRunner.run_step`), stood in for on the CPU by a tape that replays the recorded operations
    without the Python and refuses what a capture cannot hold (:mod:`graph_tape`). Every strategy row of every
    bundled model, a left-padded batch of 2, greedy or seeded (temperature and top-k, one generator per row): the
    eager runtime's tokens, counters and generator states, in the call that captures and in later calls that
    replay; steps were captured; a third call captures nothing new."""
    tokenizer, model, spec = _spec(bundled, name, strategy)
    texts = _texts(name)
    for m in (model, spec.draft_model):
        if m is not None:
            clear_static_state(m)
    sampling = {}
    if sampled:
        sampling = dict(do_sample=True, temperature=0.8, top_k=20)
    runs = []
    for cache in (None, "static", "static", "static"):
        generators = [torch.Generator().manual_seed(7 + i) for i in range(len(texts))] if sampled else None
        extra = {"generator": generators} if sampled else {}
        out = _generate(model, tokenizer, texts, spec, cache_implementation=cache, **sampling, **extra)
        runs.append((out, generator_states(generators) if sampled else None))
        if len(runs) == 3:     # (a call's first forward runs its step eagerly: the second call captures that one)
            captures = [state.graphs.captures for state in _states(model, spec)]
    (eager, eager_states), *static = runs
    for label, (out, states) in zip(("captured", "replayed", "replayed again"), static):
        _assert_same(eager, out, f"{name} / {spec.label}, {label}")
        assert states == eager_states, f"{label}: generators left in another state"
    states = _states(model, spec)
    assert _step_graphs(states), "no decoding step was captured"
    assert "target: static cache, cuda_graph, whole steps" in static[-1][0].spec_stats.runtime   # says so
    assert [state.graphs.captures for state in states] == captures, "a graph was captured twice"
    assert all(state.graphs.failure is None for state in states)


#: Two calls' sampling settings: the same processors with other values (other step keys), the suppressed ids a
#: tensor the call makes.
SETTINGS = (dict(do_sample=True, temperature=0.5, top_k=20, suppress_tokens=[5], epsilon_cutoff=1e-3),
            dict(do_sample=True, temperature=1.4, top_k=20, suppress_tokens=[5, 6], epsilon_cutoff=2e-3))


@pytest.mark.parametrize("name,strategy", fast_first([(name, s) for name, (rows, _) in CASES.items() for s in rows]))
def test_captured_steps_serve_later_calls_of_other_settings(name, strategy, bundled, replayed_graphs,
                                                            as_users_run_it):
    """A graph holds what it read at capture: a call's own tensors (a `SuppressTokensLogitsProcessor`'s ids, made by
    each call) are graph inputs, copied in at each replay, not the capturing call's (freed after it; before, the
    tape refused them). Calls of two settings, each captured then replayed in a later call, give the eager
    runtime's tokens and counters."""
    tokenizer, model, spec = _spec(bundled, name, strategy)
    texts = _texts(name)
    for m in (model, spec.draft_model):
        if m is not None:
            clear_static_state(m)

    def run(settings: dict, cache):
        generators = [torch.Generator().manual_seed(5 + i) for i in range(len(texts))]
        return _generate(model, tokenizer, texts, spec, cache_implementation=cache, generator=generators, **settings)

    for settings in (*SETTINGS, *SETTINGS):       # the second round replays the graphs the first captured
        eager = run(settings, None)
        for label in ("captured", "replayed"):
            _assert_same(eager, run(settings, "static"), f"{name} / {spec.label}, {settings}, {label}")
    assert _step_graphs(_states(model, spec)), "no decoding step was captured"


def test_simsd_eos_gate_is_captured(bundled, replayed_graphs, as_users_run_it):
    """SimSD's EOS gate (`eos_min_prob`) in the captured verify step makes its stop ids on the device, not from a host
    list (a capture refuses the copy; before, every capture of the step failed and the target ran without graphs):
    the eager runtime's tokens and counters, the step captured, no capture failed."""
    tokenizer, model, spec = _spec(bundled, "sdar-large", "simsd")
    texts = _texts("sdar-large")
    for m in (model, spec.draft_model):
        clear_static_state(m)
    free = _generate(model, tokenizer, texts, spec, max_new_tokens=16)
    stop = int(free.sequences[0, -10])                       # a token the call emits: the gate has work to do
    runs = [_generate(model, tokenizer, texts, spec, cache_implementation=cache, eos_token_id=[stop],
                      eos_min_prob=0.99, max_new_tokens=16) for cache in (None, "static", "static")]
    for label, out in zip(("captured", "replayed"), runs[1:]):
        _assert_same(runs[0], out, f"simsd eos gate, {label}")
    states = _states(model, spec)
    assert _step_graphs(states) and all(state.graphs.failure is None for state in states)


def test_eta_cutoff_runs_its_steps_eagerly_under_graphs(bundled, replayed_graphs, as_users_run_it):
    """`eta_cutoff`'s warper validates its distribution on the host, which a capture cannot hold (before, every
    step's capture failed): its steps run eagerly, the forwards captured, the eager runtime's tokens."""
    tokenizer, model, spec = _spec(bundled, "sdar-tiny-arith", "s2d2")
    texts = _texts("sdar-tiny-arith")
    clear_static_state(model)
    runs = []
    for cache in (None, "static", "static"):
        generators = [torch.Generator().manual_seed(5 + i) for i in range(len(texts))]
        runs.append(_generate(model, tokenizer, texts, spec, cache_implementation=cache, generator=generators,
                              do_sample=True, eta_cutoff=1e-3))
    for label, out in zip(("captured", "replayed"), runs[1:]):
        _assert_same(runs[0], out, f"eta_cutoff, {label}")
    assert "forwards only" in runs[-1].spec_stats.runtime
    assert all(state.graphs.failure is None for state in static_states(model))


@pytest.mark.parametrize("name,strategy", fast_first([("sdar-tiny-arith", "s2d2"), ("sdar-tiny-arith", "dynamic"),
                                                      ("llada2-tiny", "llada2"), ("fast-dllm-v2-tiny", "s2d2"),
                                                      ("sdar-large", "simsd"), ("qwen2-tiny-ar", "deer")]))
def test_captured_steps_stream_the_eager_calls(name, strategy, bundled, replayed_graphs, as_users_run_it):
    """Batch 1 with a streamer (`put` and `put_draft`), each step captured (stood in for on the CPU): the same
    streamer calls in the same order as the eager runtime, in the call that captures and in one that replays."""
    tokenizer, model, spec = _spec(bundled, name, strategy)
    texts = _texts(name, 1)
    for m in (model, spec.draft_model):
        if m is not None:
            clear_static_state(m)
    streamed = []
    for cache in (None, "static", "static"):
        streamer = Recorder()
        _generate(model, tokenizer, texts, spec, cache_implementation=cache, streamer=streamer, max_new_tokens=12)
        streamed.append(streamer.events)
    assert streamed[1] == streamed[0] and streamed[2] == streamed[0]
    assert any(kind == "draft" for kind, _ in streamed[0])
    assert _step_graphs(_states(model, spec)), "no decoding step was captured"


def test_graphs_are_captured_and_replayed_under_the_models_device(monkeypatch):
    """Finding 1: a model on another GPU than the thread's current one (a drafter on cuda:1) must be captured and
    replayed under its own device. Stood in for on the CPU: the table of a "cuda:1" model, the forward on CPU
    tensors; warm-up, capture and every replay check the device they run under."""
    monkeypatch.setattr(graphs_runtime, "device_guard", GUARD)
    graphs = ReplayedGraphs(torch.device("cuda", 1))
    weight = torch.randn(4, 3, generator=torch.Generator().manual_seed(0))
    bound = []
    call = graphs.begin_call()
    for step in range(3):
        x = torch.randn(2, 4, generator=torch.Generator().manual_seed(step))
        out = graphs.run(("key",), lambda x, w: x @ w, (x, weight), bound.append, call)
        torch.testing.assert_close(out, x @ weight)
    assert graphs.captures == 1 and len(bound) == 3 and not GUARD.stack


def test_graph_table_is_bounded_least_recently_used_first(monkeypatch):
    monkeypatch.setattr(graphs_runtime, "device_guard", GUARD)
    graphs = ReplayedGraphs(torch.device("cpu"), max_graphs=2)
    call = graphs.begin_call()
    x = torch.ones(1, 2)
    for key in ("a", "b", "a", "c", "a", "d"):
        graphs.run((key,), lambda x: x * 2, (x,), lambda buffers: None, call)
    assert list(graphs.graphs) == [("a",), ("d",)] and graphs.evictions == 2 and graphs.captures == 4


def test_a_padded_batch_replays_on_zero_padding_rows(monkeypatch):
    """A step whose batch is below its rows bucket: the live rows go into the buffers' first rows and the padding
    rows are zeros at every replay (a batch of 3 after one of 2 in the same bucket of 4 leaves no stale row), the
    outputs come back cut to the live rows, and no padded tensor is made on the host (no `cat`)."""
    monkeypatch.setattr(graphs_runtime, "device_guard", GUARD)
    graphs = ReplayedGraphs(torch.device("cpu"))
    call = graphs.begin_call()
    scale = torch.arange(1.0, 5.0)                                         # a "fixed-shape" input, bucket rows

    def step(x, flags, scale):                  # each output row sees every row: stale padding would show
        total = (x * scale[:, None]).sum(0, keepdim=True) + flags.sum()
        return x * 2 + total, flags

    def padded(t):
        return torch.cat([t, t.new_zeros(4 - t.shape[0], *t.shape[1:])])

    g = torch.Generator().manual_seed(0)
    for i, n in enumerate((3, 2, 3, 1, 2)):
        x, flags = torch.randn(n, 5, generator=g), torch.randint(0, 7, (n,), generator=g)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            out = graphs.run(("k",), step, (x, flags, scale), lambda buffers: None, call,
                             padded=[True, True, False], rows=4)
        want = step(padded(x), padded(flags), scale)
        assert all(torch.equal(a, b[:n]) for a, b in zip(out, want)), n
        if i:                                                                   # replays (the first call captured)
            assert "aten::cat" not in {e.name for e in prof.events()}
    assert graphs.captures == 1 and set(graphs.graphs[("k",)].views) == {1, 2, 3}


def test_replay_copies_go_one_foreach_per_dtype():
    """The copies around a replay (inputs into the graph's buffers, outputs out) are one `_foreach_copy_` per pair
    of dtypes, not one `copy_` per tensor (a kernel launch each on a GPU); the values are the sources', strided
    sources included, and the fresh copies own their memory."""
    g = torch.Generator().manual_seed(0)
    sources = [torch.randn(3, 5, generator=g), torch.randint(0, 9, (3,), generator=g),
               torch.randn(5, 3, generator=g).t(), torch.rand(3, 4, generator=g) > 0.5, torch.randn(2, 1, generator=g)]
    targets = [torch.zeros_like(t, memory_format=torch.contiguous_format) for t in sources]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        graphs_runtime.copy_many(targets, sources)
    top = [e.name for e in prof.events() if e.name.startswith("aten::") and e.cpu_parent is None]
    assert top == ["aten::_foreach_copy_"] * 3                              # float32, int64, bool
    for target, source in zip(targets, sources):
        assert torch.equal(target, source)
    fresh = graphs_runtime.fresh_copies([sources[0], None, sources[2], sources[3]])
    assert fresh[1] is None and all(torch.equal(a, b) for a, b in zip(fresh[::2], sources[::2]))
    assert fresh[3].dtype == torch.bool and torch.equal(fresh[3], sources[3])
    assert all(t.untyped_storage().data_ptr() != s.untyped_storage().data_ptr()
               for t, s in zip((fresh[0], fresh[2], fresh[3]), (sources[0], sources[2], sources[3])))


def test_failed_capture_cleans_up_retries_once_and_can_be_cleared(bundled, replayed_graphs, monkeypatch,
                                                                    one_thread, caplog):
    """Finding 3: a failed capture does not poison the model. The call that failed runs eager forwards (tokens
    unchanged) and says why in `spec_stats.runtime`; the next call tries once more; after a second failure the
    model stays eager without trying; `clear_static_state` clears the record."""
    tokenizer, model, spec = _spec(bundled, "sdar-tiny-arith", "dynamic")
    clear_static_state(model)
    monkeypatch.setattr(ReplayedGraphs, "fail", True)
    texts = _texts("sdar-tiny-arith")
    eager = _generate(model, tokenizer, texts, spec)
    first = _generate(model, tokenizer, texts, spec, cache_implementation="static")
    _assert_same(eager, first, "failed capture")
    assert ("static cache, cuda_graph (CUDA graph capture failed (operation not permitted when stream is "
            "capturing): eager forwards in this call, retried once later)") in first.spec_stats.runtime
    assert "CUDA graph capture failed" in caplog.text
    assert ReplayedGraphs.capture_calls == 1                      # not retried within the call that failed
    second = _generate(model, tokenizer, texts, spec, cache_implementation="static")
    _assert_same(eager, second, "failed capture, retried")
    assert ReplayedGraphs.capture_calls == 2 and "failed 2 times" in second.spec_stats.runtime
    third = _generate(model, tokenizer, texts, spec, cache_implementation="static")
    _assert_same(eager, third, "failed capture, given up")
    assert ReplayedGraphs.capture_calls == 2 and "until `clear_static_state(model)`" in third.spec_stats.runtime
    clear_static_state(model)
    monkeypatch.setattr(ReplayedGraphs, "fail", False)
    fourth = _generate(model, tokenizer, texts, spec, cache_implementation="static")
    _assert_same(eager, fourth, "after clear_static_state")
    assert fourth.spec_stats.runtime == "target: static cache, cuda_graph, forwards only"   # (layouts checked)
    assert static_states(model)[0].graphs.captures > 0


def test_a_failure_in_one_call_is_retried_in_the_next(bundled, replayed_graphs, monkeypatch, one_thread):
    tokenizer, model, spec = _spec(bundled, "sdar-tiny-arith", "dynamic")
    clear_static_state(model)
    texts = _texts("sdar-tiny-arith")
    monkeypatch.setattr(ReplayedGraphs, "fail", True)
    _generate(model, tokenizer, texts, spec, cache_implementation="static")
    monkeypatch.setattr(ReplayedGraphs, "fail", False)
    second = _generate(model, tokenizer, texts, spec, cache_implementation="static")
    _assert_same(_generate(model, tokenizer, texts, spec), second, "retried")
    assert static_states(model)[0].graphs.captures > 0
    assert "retried in this call" in second.spec_stats.runtime
    clear_static_state(model)


def test_a_failed_capture_drops_the_graphs_captured_before(bundled, replayed_graphs, monkeypatch, one_thread):
    """A capture that fails after others succeeded drops every graph of the model and role and their memory pool
    (the allocator may still route to it): the failing call gives the eager tokens and holds no graph after."""
    tokenizer, model, spec = _spec(bundled, "sdar-tiny-arith", "dynamic")
    clear_static_state(model)
    texts = _texts("sdar-tiny-arith")
    _generate(model, tokenizer, texts, spec, cache_implementation="static")
    (state,) = static_states(model)
    assert state.graphs.graphs and state.graphs.failure is None
    monkeypatch.setattr(ReplayedGraphs, "fail", True)
    one = texts[:1]                                              # batch 1: shapes not captured yet
    failed = _generate(model, tokenizer, one, spec, cache_implementation="static")
    _assert_same(_generate(model, tokenizer, one, spec), failed, "failed after successes")
    assert state.graphs.failure is not None and state.graphs.graphs == {} and state.graphs.pool is None
    clear_static_state(model)


def test_a_graph_that_differs_from_eager_is_dropped(bundled, replayed_graphs, monkeypatch, one_thread):
    """bitsandbytes#1308 (wrong 4-bit outputs under CUDA graphs), stood in for by a replay that adds 1 to every
    logit: the first replay of each capture is checked against its eager forward, the graph is dropped, the call
    runs eager forwards with the eager tokens and says why."""
    tokenizer, model, spec = _spec(bundled, "sdar-tiny-arith", "s2d2")
    clear_static_state(model)
    monkeypatch.setattr(ReplayedGraphs, "corrupt", True)
    texts = _texts("sdar-tiny-arith")
    static = _generate(model, tokenizer, texts, spec, cache_implementation="static")
    _assert_same(_generate(model, tokenizer, texts, spec), static, "corrupt replay")
    assert "the replayed graph differs from its eager run" in static.spec_stats.runtime
    assert static_states(model)[0].graphs.captures == 0
    clear_static_state(model)


def test_a_draining_batch_replays_a_few_row_buckets(bundled, replayed_graphs, one_thread):
    """Finding 6: rows that finish leave the batch, and the captured forwards pad the rest to a power of two, so a
    batch of 8 that drains to 1 captures at most 4 row sizes per width (not one per row count)."""
    tokenizer, model, spec = _spec(bundled, "sdar-tiny-arith", "dynamic")
    clear_static_state(model)
    texts = _texts("sdar-tiny-arith", 8)
    eager = _generate(model, tokenizer, texts, spec, max_new_tokens=24)
    static = _generate(model, tokenizer, texts, spec, cache_implementation="static", max_new_tokens=24)
    _assert_same(eager, static, "draining batch")
    lengths = [int(n) for n in (eager.sequences != tokenizer.pad_token_id).sum(dim=1)]
    assert len(set(lengths)) > 2, "the rows must finish at different steps for this test to drain the batch"
    (state,) = static_states(model)
    rows = {key[0] for key in state.graphs.graphs}
    assert rows <= {1, 2, 4, 8} and len(rows) > 1, rows
    clear_static_state(model)


@pytest.mark.slow
def test_graph_count_stays_bounded_over_calls_of_mixed_lengths(bundled, replayed_graphs, one_thread):
    """Finding 6: 120 calls of mixed batch sizes, prompt lengths and budgets never hold more graphs than the
    configured bound (least recently used graphs go), the cache grows by doubling a few times only, and sampled
    calls keep the eager tokens."""
    tokenizer, model, spec = _spec(bundled, "sdar-tiny-arith", "dynamic")
    clear_static_state(model)
    hf_dllm_spec.configure_static_runtime(model, max_graphs=12)
    rng = random.Random(0)
    prompts = _texts("sdar-tiny-arith", 8)
    sizes, lengths = [], set()
    try:
        for call in range(120):
            texts = [prompts[rng.randrange(8)][: rng.randint(1, 60)] for _ in range(rng.randint(1, 3))]
            budget = rng.choice([1, 4, 8])
            static = _generate(model, tokenizer, texts, spec, cache_implementation="static", max_new_tokens=budget)
            if call % 40 == 0:
                _assert_same(_generate(model, tokenizer, texts, spec, max_new_tokens=budget), static, f"call {call}")
            (state,) = static_states(model)
            sizes.append(len(state.graphs.graphs))
            lengths.add(state.cache.max_cache_len)
        assert max(sizes) <= 12 and state.graphs.evictions > 0
        assert len(lengths) <= 3, sorted(lengths)
    finally:
        hf_dllm_spec.configure_static_runtime(model)
        clear_static_state(model)


def test_configure_static_runtime_checks_its_bound(sdar_model):
    with pytest.raises(ValueError, match="max_graphs"):
        hf_dllm_spec.configure_static_runtime(sdar_model, max_graphs=0)


# -- finding 4: the autograd mode of the first call ---------------------------------------------------------------
@pytest.mark.parametrize("name,strategy", [(name, s) for name, (rows, _) in CASES.items() for s in rows])
def test_inference_mode_then_no_grad_then_plain(name, strategy, bundled, one_thread):
    """A first static call under `torch.inference_mode()` creates the state; later calls under `no_grad` and with
    no context reuse it (in-place writes into buffers made outside inference mode): the eager tokens each time."""
    tokenizer, model, spec = _spec(bundled, name, strategy)
    for m in (model, spec.draft_model):
        if m is not None:
            clear_static_state(m)
    texts = _texts(name)
    eager = _generate(model, tokenizer, texts, spec)
    with torch.inference_mode():
        first = _generate(model, tokenizer, texts, spec, cache_implementation="static")
    with torch.no_grad():
        second = _generate(model, tokenizer, texts, spec, cache_implementation="static")
    third = _generate(model, tokenizer, texts, spec, cache_implementation="static")
    for label, out in (("inference_mode", first), ("no_grad", second), ("plain", third)):
        _assert_same(eager, out, f"{name} / {spec.label}, {label}")


def test_inference_mode_with_captured_graphs(bundled, replayed_graphs, one_thread):
    tokenizer, model, spec = _spec(bundled, "sdar-tiny-arith", "s2d2")
    clear_static_state(model)
    texts = _texts("sdar-tiny-arith")
    eager = _generate(model, tokenizer, texts, spec)
    with torch.inference_mode():
        _assert_same(eager, _generate(model, tokenizer, texts, spec, cache_implementation="static"), "inference")
    _assert_same(eager, _generate(model, tokenizer, texts, spec, cache_implementation="static"), "plain")
    clear_static_state(model)


# -- finding 5: threads --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name,strategy,rounds", [("sdar-tiny-arith", "s2d2", 50),
                                                  ("qwen2-tiny-ar", "deer", 10),
                                                  ("fast-dllm-v2-tiny", "fast_dllm_v2", 10)])
def test_two_threads_on_one_model_get_their_own_tokens(name, strategy, rounds, bundled, one_thread):
    """Two threads call the static runtime of one model `rounds` times each with different prompts: each call waits
    its turn and returns its single-thread tokens (never another thread's, never a stray error)."""
    tokenizer, model, spec = _spec(bundled, name, strategy)
    texts = _texts(name, 4)
    work = {0: texts[:1], 1: texts[1:4]}
    expected = {t: _generate(model, tokenizer, work[t], spec).sequences.tolist() for t in work}
    results: dict[int, list] = {0: [], 1: []}

    def worker(t):
        for _ in range(rounds):
            try:
                results[t].append(_generate(model, tokenizer, work[t], spec,
                                            cache_implementation="static").sequences.tolist())
            except Exception as error:                    # noqa: BLE001 - any error is a failure of the test
                results[t].append(repr(error))

    threads = [threading.Thread(target=worker, args=(t,)) for t in work]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=600)
    for t in work:
        wrong = [r for r in results[t] if r != expected[t]]
        assert len(results[t]) == rounds and not wrong, f"thread {t}: {len(wrong)} of {rounds} wrong: {wrong[:2]}"


def test_a_nested_static_call_on_the_same_model_is_refused(bundled, one_thread):
    """A streamer that calls `generate` on the same model from inside a static call: a clear error naming the rule
    and the fix (the eager runtime for the inner call); the eager inner call works."""
    tokenizer, model, spec = _spec(bundled, "sdar-tiny-arith", "dynamic")
    texts = _texts("sdar-tiny-arith", 1)
    seen, puts = [], []

    class Nested:
        def put(self, value):
            puts.append(value)
            if seen or len(puts) < 2:             # the first put is the prompt; then committed tokens
                return
            for implementation in ("static", None):
                try:
                    seen.append(_generate(model, tokenizer, texts, spec, cache_implementation=implementation))
                except ValueError as error:
                    seen.append(error)

        def end(self):
            pass

    _generate(model, tokenizer, texts, spec, cache_implementation="static", streamer=Nested())
    refused, inner = seen
    assert isinstance(refused, ValueError) and "cache_implementation" in str(refused) and "eager" in str(refused)
    _assert_same(_generate(model, tokenizer, texts, spec), inner, "eager inner call")


# -- finding 2: MoE experts a graph can capture ---------------------------------------------------------------------
def test_experts_kernel_is_chosen_per_dtype_and_device(bundled, monkeypatch):
    """transformers' "grouped_mm" experts fall back to a host-synchronising path under torch.compile for anything
    but bfloat16, and on CUDA for other dtypes or cards below SM80: there the static runtime runs "batched_mm"."""
    from hf_dllm_spec.runtime.experts import capturable_experts, grouped_mm_capturable

    cuda = torch.device("cuda")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert grouped_mm_capturable(torch.bfloat16, cuda, compiled=False)[0]
    assert grouped_mm_capturable(torch.bfloat16, cuda, compiled=True)[0]
    for dtype in (torch.float32, torch.float16):
        assert not grouped_mm_capturable(dtype, cuda, compiled=False)[0]
        assert not grouped_mm_capturable(dtype, torch.device("cpu"), compiled=True)[0]
        assert grouped_mm_capturable(dtype, torch.device("cpu"), compiled=False)[0]
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    assert not grouped_mm_capturable(torch.bfloat16, cuda, compiled=False)[0]
    _, llada2 = bundled["llada2-tiny"]
    _, sdar = bundled["sdar-tiny-arith"]
    assert llada2.dtype == torch.float32
    assert capturable_experts(llada2, "cuda_graph", cuda)[0] == "batched_mm"
    assert capturable_experts(llada2, "compile", torch.device("cpu"))[0] == "batched_mm"
    assert capturable_experts(llada2, "eager", cuda) == (None, "")
    assert capturable_experts(llada2, "cuda_graph", torch.device("cpu")) == (None, "")
    assert capturable_experts(sdar, "cuda_graph", cuda) == (None, "")


@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_batched_mm_experts_equal_the_eager_experts(llada2_model, dtype, tolerance):
    from hf_dllm_spec.runtime.experts import experts_configs, experts_implementation

    model = copy.deepcopy(llada2_model).to(dtype)
    ids = torch.randint(0, 90, (2, 9), generator=torch.Generator().manual_seed(1))
    configs = experts_configs(model)
    assert configs and all(config._experts_implementation == "grouped_mm" for config in configs)
    with torch.no_grad():
        grouped = model(ids).logits
        with experts_implementation(configs, "batched_mm"):
            assert all(config._experts_implementation == "batched_mm" for config in configs)
            batched = model(ids).logits
        with experts_implementation(configs, "eager"):
            eager = model(ids).logits
    assert all(config._experts_implementation == "grouped_mm" for config in configs)        # restored
    scale = eager.abs().max()
    torch.testing.assert_close(batched / scale, eager / scale, rtol=tolerance, atol=tolerance)
    torch.testing.assert_close(grouped / scale, eager / scale, rtol=tolerance, atol=tolerance)


def test_static_runtime_runs_the_capturable_experts_and_says_so(bundled, replayed_graphs, monkeypatch, one_thread):
    """Where "grouped_mm" would not be captured, the forwards of the static runtime run "batched_mm" (and only
    they: the model's own setting is back after the call); tokens equal the eager runtime's."""
    tokenizer, model, spec = _spec(bundled, "llada2-tiny", "llada2")
    clear_static_state(model)
    monkeypatch.setattr(static_runtime, "capturable_experts", lambda model, mode, device: ("batched_mm", "test"))
    seen = []
    forward = type(model.model.layers[-1].mlp.experts).forward

    def spy(self, *args, **kwargs):
        seen.append(self.config._experts_implementation)
        return forward(self, *args, **kwargs)

    texts = _texts("llada2-tiny")
    eager = _generate(model, tokenizer, texts, spec)
    monkeypatch.setattr(type(model.model.layers[-1].mlp.experts), "forward", spy)
    static = _generate(model, tokenizer, texts, spec, cache_implementation="static")
    _assert_same(eager, static, "batched_mm experts")
    assert seen and set(seen) == {"batched_mm"}
    assert "experts: batched_mm (test)" in static.spec_stats.runtime
    assert model.config._experts_implementation == "grouped_mm"
    clear_static_state(model)


# -- finding 7 and 8: the attended prefix; bitsandbytes ----------------------------------------------------------
def test_attention_spans_a_bucketed_prefix_not_the_allocated_cache(sdar_model):
    """After a long call grew the model's cache, a short call attends over the prefix its rows need (the longest
    row plus the query, rounded up to a power of two), not the whole allocated length; logits stay the eager ones."""
    patch = model_patches.get_patch(sdar_model)
    clear_static_state(sdar_model)
    StaticModelRunner(sdar_model, patch, BatchStats(1), batch_size=1, max_cache_len=1000)      # a long earlier call
    eager = ModelRunner(sdar_model, patch, BatchStats(2), batch_size=2)
    static = StaticModelRunner(sdar_model, patch, BatchStats(2), batch_size=2, max_cache_len=16)
    assert static.cache.max_cache_len >= 1000
    ids = torch.randint(0, 90, (2, 6), generator=torch.Generator().manual_seed(0))
    step = dict(input_ids=ids, position_ids=torch.arange(6).expand(2, 6), intra_mask=causal_mask(6), kind="prefill",
                store_len=6)
    shapes = []
    layer = static.cache.layers[0]
    update = type(layer).update

    def spy(self, *args, **kwargs):
        keys, values = update(self, *args, **kwargs)
        shapes.append(tuple(keys.shape))
        return keys, values

    with pytest.MonkeyPatch.context() as patcher:
        patcher.setattr(type(layer), "update", spy)
        torch.testing.assert_close(static.forward(**step), eager.forward(**step), rtol=1e-5, atol=1e-5)
    assert shapes[0][2] == static_runtime.prefix_bucket(8, static.cache.max_cache_len) == 64
    clear_static_state(sdar_model)


def test_compile_plan_follows_the_bitsandbytes_rules(sdar_model, monkeypatch):
    """4-bit: captured (each capture checked against eager); 8-bit: eager, with the reason; neither compiled."""
    monkeypatch.setattr(static_runtime, "execution_device", lambda model: torch.device("cuda"))

    def quantized(bits):
        config = SimpleNamespace(quant_method="bitsandbytes", load_in_4bit=bits == 4, load_in_8bit=bits == 8)
        return SimpleNamespace(is_compileable=False, quantization_config=config)

    monkeypatch.setattr(sdar_model, "hf_quantizer", quantized(4), raising=False)
    mode, reason = compile_plan(sdar_model, GenerationConfig(cache_implementation="static"))
    assert mode == "cuda_graph" and "checked against its eager forward" in reason
    assert compile_plan(sdar_model, GenerationConfig(compile_config=CompileConfig()))[0] == "eager"
    monkeypatch.setattr(sdar_model, "hf_quantizer", quantized(8), raising=False)
    mode, reason = compile_plan(sdar_model, GenerationConfig(cache_implementation="static"))
    assert mode == "eager" and "8-bit" in reason


def test_bitsandbytes_4bit_captures_forwards_but_not_steps(sdar_model, monkeypatch, as_users_run_it):
    """A 4-bit model's captured forwards are each checked on their logits; its decoding steps are not captured
    whole (a step's tokens could pass the first-replay check while a later replay differs, bitsandbytes#1308)."""
    def runner():
        return StaticModelRunner(sdar_model, model_patches.get_patch(sdar_model), BatchStats(1), batch_size=1,
                                 max_cache_len=16, compile_mode="cuda_graph")

    assert runner().runs_compiled_steps
    config = SimpleNamespace(quant_method="bitsandbytes", load_in_4bit=True, load_in_8bit=False)
    monkeypatch.setattr(sdar_model, "hf_quantizer", SimpleNamespace(quantization_config=config), raising=False)
    assert not runner().runs_compiled_steps
    clear_static_state(sdar_model)


# -- hf-dllm-spec check-gpu ----------------------------------------------------------------------------------------
def test_check_gpu_rows_on_stood_in_graphs(replayed_graphs, monkeypatch, as_users_run_it):
    """check-gpu's first check, run on the CPU with capture stood in for: every row compares tokens and counters
    with the eager runtime and reports the capture (whole decoding steps captured); a failed capture makes its row
    fail."""
    monkeypatch.setattr(check_gpu, "CASES", {"sdar-tiny-arith": (["dynamic"], None),
                                             "qwen2-tiny-ar": (["deer"], "deer-drafter-tiny")})
    rows = check_gpu.check_tokens(torch.device("cpu"), torch.float32, max_new_tokens=8)
    assert [row["ok"] for row in rows] == [True, True], rows
    assert all(row["tokens_equal"] and row["graph_equal"] and row["captured"] and "cuda_graph" in row["runtime"]
               and row["steps"][0] > 0 for row in rows)
    monkeypatch.setattr(ReplayedGraphs, "fail", True)
    (failed, _) = check_gpu.check_tokens(torch.device("cpu"), torch.float32, max_new_tokens=8)
    assert failed["tokens_equal"] and not failed["captured"] and not failed["ok"]
    result = {"machine": "cpu", "tokens": rows + [failed], "ok": False, "seconds": 1.0,
              "memory": {"calls": 2, "memory_bytes": [1, 1], "graphs": [3, 3], "ok": True}}
    text = check_gpu.report(result)
    assert text.count("ok   float32") == 2 and "FAIL float32" in text and text.endswith("FAIL in 1 s")
    speed = {"shape": "SDAR-1.7B", "stock_step_s": 0.004, "compiled": True, "target": 1.3,
             "widths": [{"q": 1, "seconds": 0.0052, "ratio": 1.3, "met": True}],
             "compiled_widths": [{"q": 1, "seconds": 0.006, "ratio": 1.5, "met": False}]}
    lines = check_gpu.report(dict(result, speed=speed)).splitlines()
    assert "  width   1:    5.20 ms  ratio 1.30  met" in lines
    assert "  width   1:    6.00 ms  ratio 1.50  not met  compiled (compile_config)" in lines
    alone = check_gpu.report(dict(result, speed=speed, tokens=[], memory=None, ok=True))       # --speed-only
    assert "1. static" not in alone and "2. memory" not in alone and "3. captured forward" in alone


def test_check_gpu_refuses_without_cuda(capsys, monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    from hf_dllm_spec.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["check-gpu"])
    assert exit_info.value.code == 2 and "argument --device: names a CUDA device ('cuda') but torch here sees none" \
        in capsys.readouterr().err
    for device in ("foo", "cpu"):                      # a traceback from torch.device; not a CUDA device
        with pytest.raises(SystemExit) as exit_info:
            main(["check-gpu", "--device", device])
        err = capsys.readouterr().err
        assert exit_info.value.code == 2 and "Traceback" not in err, err
        assert ("argument --device: must be a torch device" if device == "foo" else
                "`--device` (='cpu') must be a CUDA device: check-gpu needs one") in err, err
    with pytest.raises(SystemExit) as exit_info:
        main(["check-gpu", "--compiled-widths", "8,x"])
    assert exit_info.value.code == 2 and "`--compiled-widths` (='8,x') must be comma-separated positive" in \
        capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        main(["check-gpu", "--speed-only", "--no-speed"])
    assert exit_info.value.code == 2 and "`--speed-only` (=True) must not be given with --no-speed" in \
        capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        main(["check-gpu", "--calls", "1"])                   # check 2 compares the last call with the second
    assert exit_info.value.code == 2 and "`--calls` (=1) must be at least 2" in capsys.readouterr().err
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(SystemExit) as exit_info:
        main(["check-gpu", "--device", "cuda:3"])
    assert exit_info.value.code == 2 and "argument --device: names 'cuda:3' but torch sees 1 CUDA device(s): pass " \
        "cuda:0 ... cuda:0" in capsys.readouterr().err


def test_compile_plan_keeps_tensor_parallel_models_eager(sdar_model, monkeypatch):
    """Capturing or compiling a sharded model's collectives is not verified: eager forwards, with the reason."""
    monkeypatch.setattr(static_runtime, "execution_device", lambda model: torch.device("cuda"))
    assert compile_plan(sdar_model, GenerationConfig(cache_implementation="static"))[0] == "cuda_graph"
    monkeypatch.setattr(sdar_model, "_tp_size", 2, raising=False)
    mode, reason = compile_plan(sdar_model, GenerationConfig(cache_implementation="static"))
    assert mode == "eager" and "tensor-parallel model (tp_size=2)" in reason
