"""The static runtime (`cache_implementation="static"`) gives the eager runtime's tokens and forward counts.

Every strategy on every bundled model (drafter pairs, sub-blocks, LLaDA2.1 editing), a left-padded batch, greedy and
seeded sampling, two calls that reuse the model's static state, and a cache / query width that overflows its
bucket; plus the runner itself against the eager `ModelRunner` on logits. CPU: no CUDA graphs (transformers compiles
only on accelerators); one slow test compiles a tiny model's forward with `compile_config` on the CPU, and the
CUDA-graph path runs with capture and replay stood in for by re-running the forward on the static buffers
(`_ReplayedGraphs`). Host synchronisations are counted: none inside any forward, one per forward in the loop.
"""

from __future__ import annotations

import shutil
from dataclasses import fields
from types import SimpleNamespace

import pytest
import torch
from transformers import CompileConfig, DynamicCache, GenerationConfig

import hf_dllm_spec
import hf_dllm_spec.runtime.static as static_runtime
import model_patches
from model_patches.compat import CACHE_KWARG
from hf_dllm_spec.jobs.evaluation import ROOT, arithmetic_prompts, load
from hf_dllm_spec.jobs.main import SUB_BLOCKS, specs
from hf_dllm_spec.maths.masks import causal_mask
from hf_dllm_spec.outputs import BatchStats
from hf_dllm_spec.runtime.runner import ModelRunner
from hf_dllm_spec.runtime.static import (STATE_ATTRIBUTE, StaticModelRunner, clear_static_state, compile_plan,
                                         width_bucket)
from hf_dllm_spec.runtime.syncs import count_host_syncs
from hf_dllm_spec.runtime.trace import trace_forwards

MODELS = ROOT / "models"
MAX_NEW_TOKENS = 8
#: model -> (strategy rows of the main job on it, drafter): every strategy, every family.
CASES = {
    "sdar-tiny-arith": (["ar", "static", "dynamic", "s2d2"], None),
    "fast-dllm-v2-tiny": (["ar", "fast_dllm_v2", "s2d2"], None),
    "llada2-tiny": (["llada2", "s2d2-llada2"], None),
    "sdar-large": (["simsd"], "sdar-tiny-arith"),
    "qwen2-tiny-ar": (["ar", "deer"], "deer-drafter-tiny"),
}
TIMES = {"wall_time_s", "prefill_time_s", "forward_time_s", "draft_model_time_s", "warmup_time_s", "runtime"}


def counters(stats) -> dict:
    return {f.name: getattr(stats, f.name) for f in fields(stats) if f.name not in TIMES}


@pytest.fixture(scope="module")
def bundled():
    """name -> (tokenizer, model), loaded once."""
    return {name: load(MODELS / name) for name in {*CASES, "deer-drafter-tiny"}}


def _generate(model, tokenizer, texts, spec, **kwargs):
    tokenizer.padding_side = "left"
    enc = tokenizer(texts, return_tensors="pt", padding=True)
    entry = {} if isinstance(model, hf_dllm_spec.DllmGenerationMixin) else {"custom_generate": hf_dllm_spec.custom_generate}
    drafter = {"draft_model": spec.draft_model} if spec.draft_model is not None else {}
    return model.generate(enc.input_ids, attention_mask=enc.attention_mask, decoding_strategy=spec.decoding_strategy,
                          return_dict_in_generate=True, **entry, **spec.params, **drafter,
                          **{"max_new_tokens": MAX_NEW_TOKENS, **kwargs})


def _assert_same(eager, static, label):
    assert static.sequences.tolist() == eager.sequences.tolist(), f"{label}: tokens differ"
    for n, (a, b) in enumerate(zip(eager.spec_stats_per_row, static.spec_stats_per_row)):
        assert counters(b) == counters(a), f"{label}: row {n} counters (NFE) differ"
    assert static.spec_stats.num_forward_calls == eager.spec_stats.num_forward_calls


def _spec(bundled, name, strategy):
    """The main job's row `strategy` for bundled model `name` (its drafter, its family's sub-blocks)."""
    strategies, drafter_name = CASES[name]
    tokenizer, model = bundled[name]
    drafter = bundled[drafter_name][1] if drafter_name else None
    patch = model_patches.get_patch(model)
    family = SUB_BLOCKS if patch.native_strategy == "fast_dllm_v2" else None
    (spec,) = specs(patch.trained_block_size(model) or 4, 0.9, [strategy], {}, family, drafter, draft_block_size=8)[-1:]
    return tokenizer, model, spec


def _texts(name, n=2):
    return [p.text for p in arithmetic_prompts(MODELS / name, n)]


@pytest.mark.parametrize("name,strategy", [(name, s) for name, (rows, _) in CASES.items() for s in rows])
def test_static_runtime_equals_eager_on_bundled_models(name, strategy, bundled, one_thread):
    """Every strategy row of every bundled model, a left-padded batch of 2, greedy: same tokens, same counters."""
    tokenizer, model, spec = _spec(bundled, name, strategy)
    texts = _texts(name)
    eager = _generate(model, tokenizer, texts, spec)
    static = _generate(model, tokenizer, texts, spec, cache_implementation="static")
    _assert_same(eager, static, f"{name} / {spec.label}")
    if spec.draft_model is not None:
        assert STATE_ATTRIBUTE in spec.draft_model.__dict__       # the drafter ran on its own static runtime


def test_second_call_reuses_the_static_state(bundled, one_thread):
    """Two calls in a row (a different batch in between): the cache object persists on the model, tokens stay."""
    tokenizer, model, spec = _spec(bundled, "sdar-tiny-arith", "s2d2")
    texts = _texts("sdar-tiny-arith", 3)
    clear_static_state(model)
    eager = _generate(model, tokenizer, texts[:2], spec)
    first = _generate(model, tokenizer, texts[:2], spec, cache_implementation="static")
    (state,) = model.__dict__[STATE_ATTRIBUTE].values()
    _generate(model, tokenizer, texts[2:], spec, cache_implementation="static")         # batch 1: same state
    second = _generate(model, tokenizer, texts[:2], spec, cache_implementation="static")
    _assert_same(eager, first, "first call")
    _assert_same(eager, second, "second call")
    assert list(model.__dict__[STATE_ATTRIBUTE].values()) == [state]


@pytest.mark.parametrize("name,strategy", [("sdar-tiny-arith", "s2d2"), ("fast-dllm-v2-tiny", "fast_dllm_v2"),
                                           ("llada2-tiny", "llada2"), ("qwen2-tiny-ar", "deer"),
                                           ("sdar-large", "simsd")])
def test_static_runtime_equals_eager_with_seeded_sampling(name, strategy, bundled, one_thread):
    tokenizer, model, spec = _spec(bundled, name, strategy)
    texts = _texts(name)
    sample = dict(do_sample=True, temperature=1.0, top_k=0)
    eager = _generate(model, tokenizer, texts, spec, generator=torch.Generator().manual_seed(3), **sample)
    static = _generate(model, tokenizer, texts, spec, generator=torch.Generator().manual_seed(3), **sample,
                       cache_implementation="static")
    _assert_same(eager, static, f"{name} / {spec.label}, sampled")


def test_overflowing_cache_and_width_buckets(bundled, monkeypatch, one_thread):
    """A cache allocated far too short grows (several times) mid-call, and widths above a small granule go to its
    multiples: tokens and counts stay the eager ones."""
    tokenizer, model = bundled["sdar-tiny-arith"]
    monkeypatch.setattr(hf_dllm_spec.integration.generate, "static_cache_length", lambda *args: 1)
    monkeypatch.setattr(static_runtime, "WIDTH_GRANULE", 8)
    monkeypatch.setattr(static_runtime, "LENGTH_GRANULE", 8)
    assert [width_bucket(w) for w in (1, 3, 8, 9, 17)] == [1, 4, 8, 16, 24]
    clear_static_state(model)
    texts = _texts("sdar-tiny-arith")
    for spec in specs(4, 0.9, ["dynamic", "s2d2"], {}):
        eager = _generate(model, tokenizer, texts, spec)
        static = _generate(model, tokenizer, texts, spec, cache_implementation="static")
        _assert_same(eager, static, f"overflow / {spec.label}")
    assert model.__dict__[STATE_ATTRIBUTE]  # grown, kept
    (state,) = model.__dict__[STATE_ATTRIBUTE].values()
    assert state.cache.max_cache_len >= max(len(tokenizer(t).input_ids) for t in texts) + MAX_NEW_TOKENS


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
    assert getattr(sdar_model, "_last_compile_config", None) == config      # transformers' compiled call ran


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
@pytest.mark.parametrize("name,strategies", [("sdar-tiny-arith", ["ar", "dynamic", "s2d2"]),
                                             ("fast-dllm-v2-tiny", ["fast_dllm_v2", "s2d2"]),
                                             ("llada2-tiny", ["llada2"]), ("sdar-large", ["simsd"]),
                                             ("qwen2-tiny-ar", ["deer"])])
def test_cuda_graphs_replay_the_eager_tokens(name, strategies):
    """On a GPU: replayed graphs give the eager tokens and counts; every forward is captured (none falls back);
    later calls capture nothing new; memory stays flat over 100 calls."""
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
        states = [*model.__dict__[STATE_ATTRIBUTE].values(),
                  *(spec.draft_model.__dict__[STATE_ATTRIBUTE].values() if spec.draft_model is not None else [])]
        # every forward is free of host syncs (test_forwards_are_sync_free_and_steps_sync_little): all captured
        assert all(state.graphs.captures > 0 and not state.graphs.failed for state in states), \
            [state.graphs.failed for state in states]
        assert "eager" not in static.spec_stats.runtime and "cuda_graph" in static.spec_stats.runtime
        captures = [state.graphs.captures for state in states]
        memory = []
        for call in range(100):
            again = _generate(model, tokenizer, texts, spec, cache_implementation="static")
            if call % 20 == 0:
                _assert_same(eager, again, f"{name} / {spec.label}, replayed")
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


# -- the CUDA-graph bookkeeping on the CPU: capture and replay stood in for by re-running the forward -----------
class _ReplayedGraphs(static_runtime._CudaGraphs):
    """`_CudaGraphs` with its two CUDA calls replaced: the warm-up runs eagerly, and "replay" runs the forward again
    on the static buffers into the static output. Everything else (keys, buffers, copies, write columns, counts,
    the fallback) is the real code."""

    fail = False

    def _warm_up(self, run_forward, buffers):
        for _ in range(self.WARMUP_RUNS):
            out = run_forward(*buffers)
        return out

    def _capture(self, run_forward, buffers):
        if self.fail:
            raise RuntimeError("operation not permitted when stream is capturing\nmore")
        static_out = run_forward(*buffers).clone()
        return (lambda: static_out.copy_(run_forward(*buffers))), static_out


@pytest.fixture
def replayed_graphs(monkeypatch):
    monkeypatch.setattr(static_runtime, "_CudaGraphs", _ReplayedGraphs)
    monkeypatch.setattr(static_runtime, "compile_plan", lambda model, config: ("cuda_graph", ""))


@pytest.mark.parametrize("name,strategy", [("sdar-tiny-arith", "s2d2"), ("fast-dllm-v2-tiny", "fast_dllm_v2"),
                                           ("llada2-tiny", "llada2"), ("sdar-large", "simsd"),
                                           ("qwen2-tiny-ar", "deer")])
def test_graph_bookkeeping_replays_the_eager_tokens(name, strategy, bundled, replayed_graphs, one_thread):
    """The "cuda_graph" path of the static runtime, capture and replay stood in for on the CPU: every forward after
    the first of its shape replays from the static buffers (the inputs copied in, the write columns read from
    their buffer), tokens and counters equal the eager runtime's, and a second call captures nothing new."""
    tokenizer, model, spec = _spec(bundled, name, strategy)
    texts = _texts(name)
    for m in (model, spec.draft_model):
        if m is not None:
            clear_static_state(m)
    eager = _generate(model, tokenizer, texts, spec)
    first = _generate(model, tokenizer, texts, spec, cache_implementation="static")
    states = [*model.__dict__[STATE_ATTRIBUTE].values(),
              *(spec.draft_model.__dict__[STATE_ATTRIBUTE].values() if spec.draft_model is not None else [])]
    captures = [state.graphs.captures for state in states]
    second = _generate(model, tokenizer, texts, spec, cache_implementation="static")
    _assert_same(eager, first, f"{name} / {spec.label}, captured")
    _assert_same(eager, second, f"{name} / {spec.label}, replayed")
    assert all(isinstance(state.graphs, _ReplayedGraphs) and state.graphs.captures for state in states)
    assert [state.graphs.captures for state in states] == captures, "a graph was captured twice"
    assert "cuda_graph" in first.spec_stats.runtime and first.spec_stats.warmup_time_s > 0


def test_failed_capture_falls_back_to_eager_forwards_and_says_why(bundled, replayed_graphs, monkeypatch,
                                                                    one_thread, caplog):
    tokenizer, model, spec = _spec(bundled, "sdar-tiny-arith", "dynamic")
    clear_static_state(model)
    monkeypatch.setattr(_ReplayedGraphs, "fail", True)
    texts = _texts("sdar-tiny-arith")
    eager = _generate(model, tokenizer, texts, spec)
    static = _generate(model, tokenizer, texts, spec, cache_implementation="static")
    _assert_same(eager, static, "failed capture")
    assert "static cache, eager (CUDA graph capture failed (operation not permitted" in static.spec_stats.runtime
    assert "CUDA graph capture failed" in caplog.text
    clear_static_state(model)
