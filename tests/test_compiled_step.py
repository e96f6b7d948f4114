"""One decoding step, one compiled function (issue 34): under `cache_implementation="static"` with a
`compile_config`, block diffusion (every remasking rule, whole blocks or sub-blocks, fused cache writes, the caching
and drafting masks `cache_ver` / `draft_ver`; AR, which inherits the step; LLaDA2.1 token editing and
`num_to_transfer`), greedy or sampled with transformers' warpers, runs each denoising step (the static runner's
forward, the proposal, edits and commits, the done flags, the step's read) as one `torch.compile(fullgraph=True)`
function. Sampling draws its noise before the step, as `torch.multinomial`
would (`categorical_from_noise`), so seeded runs give the eager tokens.

Checked on the CPU: the noise draw equals `torch.multinomial` (tokens, generator states, distribution) for a shared
generator and per-row generators; the step compiles without a graph break (fullgraph), one graph per key and no
recompilation over a 64-token call and a second call, the eager runtime's tokens and per-row counters (greedy and
seeded, shared and per-row generators, batches with left padding, rows that finish at different steps and leave
the batch), one host read per step, and every other case on today's path. Streaming (batch 1, phase 4): a
streamer gets the eager runtime's `put` / `put_draft` / `end` calls, from the step's one read.
Most tests compile with dynamo's "eager" backend (the trace and its guards, fast); one slow test runs inductor.
"""

from __future__ import annotations

import shutil

import pytest
import torch
from conftest import (MASK_ID, TINY, Recorder, assert_same_decode, cpu_compile_config, fast_first, generator_states,
                      load_first_layers, seeded, stream_on_the_host)
from transformers import CompileConfig

from hf_dllm_spec.maths.sampling import (RowGenerators, Sampler, categorical_from_noise, draw_categorical,
                                         draw_exponential)
from hf_dllm_spec.runtime.static import clear_static_state, rows_bucket, static_states
from hf_dllm_spec.runtime.step import compile_options
from hf_dllm_spec.strategies import block_diffusion

PROMPTS = [[5, 17, 42, 8, 9], [7, 3], [11, 12, 13, 14, 15, 16, 2]]
SAMPLED = dict(do_sample=True, temperature=1.5, top_k=20, top_p=0.95)


pytestmark = pytest.mark.usefixtures("as_users_run_it")


def left_padded(prompts: list[list[int]], pad: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, prompts))
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    return ids, mask


def generate(model, prompts, **kwargs):
    ids, mask = left_padded(prompts)
    return model.generate(ids, attention_mask=mask, return_dict_in_generate=True, pad_token_id=0,
                          **{"decoding_strategy": "block_diffusion", "block_size": 4, "max_new_tokens": 12,
                             "eos_token_id": None, **kwargs})


def early_stop(sequences: torch.Tensor, new: int = 12) -> int:
    """A stop id that ends row 0 early and not every other row: the first of row 0's `new` generated tokens that
    some other row never generates (so rows leave the batch at different forwards)."""
    generated = sequences[:, -new:].tolist()
    everywhere = set.intersection(*(set(row) for row in generated[1:]))
    return next(token for token in generated[0] if token not in everywhere)


def step_keys(model) -> list[tuple]:
    """The compiled steps' keys (not the plain compiled forwards', `("forward", ...)`: the prefill's)."""
    return [key for state in static_states(model) for key in state.steps.keys if key[0] != "forward"]


@pytest.mark.parametrize("per_row", [False, True])
def test_noise_draw_equals_multinomial(per_row):
    """`draw_exponential` + `categorical_from_noise` give `draw_categorical`'s tokens (`torch.multinomial`) and
    leave each generator where the multinomial leaves it, for a shared generator and per-row generators; only the
    first `rows` rows of a larger buffer are drawn."""
    probs = torch.softmax(2 * torch.randn(3, 4, 50, generator=torch.Generator().manual_seed(0)), dim=-1)
    probs[..., 7] = 0.0                                                     # a suppressed id is never drawn
    probs = probs / probs.sum(-1, keepdim=True)

    def make():
        if per_row:
            return RowGenerators([torch.Generator().manual_seed(10 + r) for r in range(3)])
        return torch.Generator().manual_seed(10)

    eager, ahead = make(), make()
    buffer = torch.full((4, 4, 50), 7.0)                                    # a padded step buffer
    noise = draw_exponential(buffer, ahead, rows=3)
    assert (buffer[3] == 7.0).all()                                         # padding rows untouched
    tokens = categorical_from_noise(probs, noise[:3])
    for _ in range(3):                                                      # the next draws stay aligned
        assert torch.equal(tokens, draw_categorical(probs, eager))
        tokens = categorical_from_noise(probs, draw_exponential(buffer, ahead, rows=3)[:3])
    assert not (tokens == 7).any()
    sampler = Sampler([], do_sample=True, suppress_token_ids=[], generator=make())
    twin = Sampler([], do_sample=True, suppress_token_ids=[], generator=make())
    chosen, confidence = sampler.choose(probs)
    assert [t.tolist() for t in twin.choose(probs, noise=twin.draw_noise(torch.empty(3, 4, 50), 3))] == \
        [chosen.tolist(), confidence.tolist()]


@pytest.mark.parametrize("per_row", [False, True])
def test_noise_draw_over_rows_of_different_widths(per_row):
    """`draw_exponential(..., widths=)` (a choice over rows of different lengths: DEER's drafts, SimSD's rows still
    drafting) draws what the eager choices draw: a shared generator one multinomial over the widest row, per-row
    generators row r's first `widths[r]` positions (a row of width 0 draws nothing); the tokens and the
    generators' states after it equal `draw_categorical`'s, positions past a row's width keep their old numbers."""
    probs = torch.softmax(torch.randn(3, 4, 30, generator=torch.Generator().manual_seed(1)), dim=-1)
    widths = [2, 0, 3]

    def make():
        if per_row:
            return RowGenerators([torch.Generator().manual_seed(20 + r) for r in range(3)])
        return torch.Generator().manual_seed(20)

    eager, ahead = make(), make()
    buffer = torch.full((4, 4, 30), 7.0)
    draw_exponential(buffer, ahead, widths=widths)
    if per_row:
        expected = [draw_categorical(probs[r, :w], eager[r]) if w else None for r, w in enumerate(widths)]
        for r, w in enumerate(widths):
            assert (buffer[r, w:] == 7.0).all()
            if w:
                assert torch.equal(categorical_from_noise(probs[r, :w], buffer[r, :w]), expected[r])
    else:
        expected = draw_categorical(probs[:, :max(widths)], eager)
        assert torch.equal(categorical_from_noise(probs[:, :3], buffer[:3, :3]), expected)
        assert (buffer[:, 3:] == 7.0).all()
    assert (buffer[3] == 7.0).all()
    states = [g.get_state() for g in (eager.generators if per_row else [eager])]
    assert all(torch.equal(a, b.get_state()) for a, b in zip(states, ahead.generators if per_row else [ahead]))


def test_noise_draw_has_the_distribution():
    """Distribution level: 40000 draws of one distribution through the noise path match it (each frequency within
    4 standard errors), as `torch.multinomial`'s do."""
    probs = torch.tensor([0.5, 0.25, 0.15, 0.07, 0.03, 0.0])
    n = 40000
    generator = torch.Generator().manual_seed(3)
    noise = draw_exponential(torch.empty(n, 6), generator)
    counts = torch.bincount(categorical_from_noise(probs.expand(n, 6), noise), minlength=6).double()
    reference = torch.bincount(torch.multinomial(probs.expand(n, 6), 1, generator=torch.Generator().manual_seed(3))
                               [:, 0], minlength=6).double()
    assert torch.equal(counts, reference)
    error = 4 * torch.sqrt(probs * (1 - probs) / n)
    assert ((counts / n - probs).abs() <= error + 1e-12).all(), counts / n


def test_compile_options_force_fullgraph_and_static_shapes_unless_asked():
    options = compile_options(CompileConfig(fullgraph=False, mode="default"))
    assert options == {"backend": "inductor", "mode": "default", "dynamic": False, "fullgraph": True}
    assert compile_options(CompileConfig(dynamic=True), fullgraph=False)["dynamic"] is True


def test_every_key_compiles_static_shapes(sdar_model):
    """A call whose steps compile several keys (a batch of 2, then 1 after row 0 leaves; with and without a pending
    block): every graph dynamo hands the backend takes inputs of fixed sizes, none symbolic. torch's default
    (`dynamic=None`) would trace the second key of each step function with symbolic sizes (its automatic-dynamic
    record is per source line, shared by the keys' copies of one function)."""
    graphs = []

    def record(graph, example_inputs):
        graphs.append(graph)
        return graph.forward

    clear_static_state(sdar_model)
    config = cpu_compile_config()
    config.backend = record
    eager = generate(sdar_model, PROMPTS[:2])
    stop = early_stop(eager.sequences)
    compiled = generate(sdar_model, PROMPTS[:2], eos_token_id=stop, cache_implementation="static",
                        compile_config=config)
    assert_same_decode(generate(sdar_model, PROMPTS[:2], eos_token_id=stop), compiled)
    assert len(step_keys(sdar_model)) > 2 and len(graphs) == len(static_states(sdar_model)[0].steps.keys)
    values = [node.meta.get("example_value") for graph in graphs for node in graph.graph.nodes
              if node.op == "placeholder"]
    sizes = [size for value in values if isinstance(value, torch.Tensor) for size in value.shape]
    assert sizes and all(type(size) is int for size in sizes)
    assert not any(isinstance(value, torch.SymInt) for value in values)
    clear_static_state(sdar_model)


@pytest.mark.parametrize("params", [{}, dict(SAMPLED, generator="rows")])
@pytest.mark.slow
def test_the_step_compiles_in_one_graph_without_recompiling(sdar_model, params):
    """A 64-token call, greedy and seeded: every step goes through a compiled step (fullgraph=True: a graph break
    raises), each key compiled once (one dynamo cache entry); a second call of new strategy and runner objects
    (and new generators seeded alike) reuses them all."""
    clear_static_state(sdar_model)
    config = cpu_compile_config()
    first = generate(sdar_model, PROMPTS[:1], max_new_tokens=64, cache_implementation="static",
                     compile_config=config, **seeded(params, 1))
    (state,) = static_states(sdar_model)
    keys = step_keys(sdar_model)
    assert len(keys) == 2 * len({key[-3] for key in keys})   # with and without a pending block, per prefix
    assert all(state.steps.graphs(key) == 1 for key in keys)
    second = generate(sdar_model, PROMPTS[:1], max_new_tokens=64, cache_implementation="static",
                      compile_config=config, **seeded(params, 1))
    assert step_keys(sdar_model) == keys and all(state.steps.graphs(key) == 1 for key in state.steps.keys)
    assert second.sequences.tolist() == first.sequences.tolist()
    assert first.spec_stats.num_forward_calls == 1 + first.spec_stats.num_denoising_steps   # prefill + steps


def test_a_graph_break_in_the_step_raises(sdar_model, monkeypatch):
    """fullgraph=True: a step that would be split into eager pieces (here a graph break in the greedy choice, where
    a host read or an untraceable call would put one) fails loudly instead of running slowly."""
    greedy = Sampler.greedy

    def breaking(self, logits):
        torch._dynamo.graph_break()
        return greedy(self, logits)

    monkeypatch.setattr(Sampler, "greedy", breaking)
    clear_static_state(sdar_model)
    with pytest.raises(torch._dynamo.exc.Unsupported):
        generate(sdar_model, PROMPTS[:1], max_new_tokens=4, cache_implementation="static",
                 compile_config=cpu_compile_config())
    clear_static_state(sdar_model)


#: The rules and settings of the compiled block-diffusion step, each checked against the eager runtime.
STEP_CASES = [
    dict(remasking_strategy="low_confidence_dynamic", confidence_threshold=0.5),
    dict(remasking_strategy="low_confidence_static", steps_per_block=2),
    dict(decoding_strategy="ar", block_size=1, max_new_tokens=10),
    dict(remasking_strategy="sequential", sub_block_size=2),
    dict(remasking_strategy="entropy_bounded", eb_threshold=0.5),
    dict(SAMPLED, generator="shared"),
    dict(SAMPLED, remasking_strategy="low_confidence_static", generator="rows"),
    dict(do_sample=True, min_p=0.05, typical_p=0.9, epsilon_cutoff=3e-4, sub_block_size=2,    # (eta_cutoff: eager)
         generator="rows"),
    dict(fuse_cache_write=False, confidence_threshold=0.5),
    dict(cache_ver=True, draft_ver=True, confidence_threshold=0.5),
]


def batch_rows(params: dict, cases: list[dict]) -> int:
    """3 rows (a rows bucket of 4 with a padding row) for the first case and a shared generator (one draw over the
    padded bucket); 2 for the others (each rows bucket is a set of graphs to compile, the cost of these tests)."""
    return 3 if params is cases[0] or params.get("generator") == "shared" else 2


@pytest.mark.parametrize("params", fast_first(STEP_CASES))
def test_tokens_and_counters_equal_the_eager_runtime(sdar_model, params):
    """A left-padded batch of 3 (or 2: :func:`batch_rows`) whose rows finish their blocks at different steps and
    leave the batch at different forwards (stop id), so the compiled step runs at fewer rows after (3 rows padded to
    4, then 2; 2 rows, then 1): tokens and every per-row counter equal the eager runtime's, greedy and seeded (one
    generator for the batch, one per row; the generators end where the eager ones end); batch 1 too (the first
    case: a batch's own key per shape is what the others add)."""
    clear_static_state(sdar_model)      # count its own graphs only (conftest.cpu_compile_config)
    rows = batch_rows(params, STEP_CASES)
    prompts = PROMPTS[:rows]
    eager = generate(sdar_model, prompts, **seeded(params, rows))
    stop = early_stop(eager.sequences, params.get("max_new_tokens", 12))
    eager_params, compiled_params = seeded(params, rows), seeded(params, rows)
    eager = generate(sdar_model, prompts, eos_token_id=stop, **eager_params)
    compiled = generate(sdar_model, prompts, eos_token_id=stop, cache_implementation="static",
                        compile_config=cpu_compile_config(), **compiled_params)
    assert_same_decode(eager, compiled)
    if "generator" in params:                                 # the step drew what the eager step drew
        assert generator_states(eager_params["generator"]) == generator_states(compiled_params["generator"])
    keys = step_keys(sdar_model)
    assert {key[-6] for key in keys} >= {rows_bucket(rows, 4), rows_bucket(rows - 1, 4)}   # row 0 left: fewer rows
    if params is STEP_CASES[0]:
        alone = generate(sdar_model, PROMPTS[2:], cache_implementation="static", compile_config=cpu_compile_config(),
                         **seeded(params, 1))
        assert_same_decode(generate(sdar_model, PROMPTS[2:], **seeded(params, 1)), alone)
    assert all(state.steps.graphs(key) == 1 for state in static_states(sdar_model) for key in state.steps.keys)


LLADA2_CASES = [
    dict(confidence_threshold=0.3, editing_threshold=0.2, max_post_steps=4),
    dict(confidence_threshold=0.5, editing_threshold=0.3, max_post_steps=2, do_sample=True, temperature=0.7,
         generator="rows"),
    dict(confidence_threshold=0.5, editing_threshold=0.3, do_sample=True, top_k=10, generator="shared"),
    dict(preset="llada2.0", confidence_threshold=0.6, steps_per_block=2),
]


@pytest.mark.parametrize("params", fast_first(LLADA2_CASES))
def test_llada2_editing_steps_equal_the_eager_runtime(llada2_model, params):
    """LLaDA2.1 (the MoE family, its experts kernel switched inside the step): token editing, post steps and
    `num_to_transfer`, greedy and seeded; LLaDA2.0's schedule (the strategy's own `scheduled_masks`). A left-padded
    batch of 3 or 2 (:func:`batch_rows`; and batch 1 in the first case): the eager runtime's tokens and per-row
    counters (edits included, which do happen)."""
    clear_static_state(llada2_model)
    first, batch = params is LLADA2_CASES[0], PROMPTS[:batch_rows(params, LLADA2_CASES)]
    params = dict(params, decoding_strategy="llada2")
    edited = 0
    for prompts in (batch, PROMPTS[:1]) if first else (batch,):
        eager = generate(llada2_model, prompts, **seeded(params, len(prompts)))
        compiled = generate(llada2_model, prompts, cache_implementation="static", compile_config=cpu_compile_config(),
                            **seeded(params, len(prompts)))
        assert_same_decode(eager, compiled)
        edited += eager.spec_stats.num_edited_tokens
    assert edited > 0 or "preset" in params
    keys = step_keys(llada2_model)
    assert keys and all(key[0] == "LLaDA2Strategy" for key in keys)
    assert all(state.steps.graphs(key) == 1 for state in static_states(llada2_model) for key in state.steps.keys)


@pytest.fixture(scope="module")
def fast_model():
    """Tiny random Fast-dLLM v2 (right-shifted, bd_size 8, mask 98)."""
    from model_patches.fast_dllm_v2 import Fast_dLLM_QwenConfig, Fast_dLLM_QwenForCausalLM

    torch.manual_seed(2)
    return Fast_dLLM_QwenForCausalLM(Fast_dLLM_QwenConfig(bd_size=8, mask_token_id=MASK_ID, **TINY)).eval()


@pytest.mark.parametrize("params", fast_first([dict(), dict(sub_block_size=2, confidence_threshold=0.5),
                                    dict(SAMPLED, generator="shared"), dict(SAMPLED, generator="rows")]))
def test_fast_dllm_v2_steps_equal_the_eager_runtime(fast_model, params):
    """Fast-dLLM v2 (right-shifted, separate cache writes, sub-blocks): the compiled step takes the carry as a
    tensor (a block's first position predicts from the last stored token); greedy, the writes and the carry's
    commits are compiled calls too (seeded, they stay eager). A left-padded batch of 3 (one prompt over a block, so
    prefilled, and two shorter ones that start without a carry), greedy and seeded, and batch 1 (the first case): the
    eager runtime's tokens and per-row counters."""
    clear_static_state(fast_model)
    first = not params
    params = dict(params, decoding_strategy="fast_dllm_v2", block_size=8, max_new_tokens=20)
    prompts = [[5, 17, 42, 8, 9, 10, 11, 12, 13, 14], *PROMPTS[1:]]
    for batch in (prompts, prompts[:1]) if first else (prompts,):
        eager = generate(fast_model, batch, **seeded(params, len(batch)))
        compiled = generate(fast_model, batch, cache_implementation="static", compile_config=cpu_compile_config(),
                            **seeded(params, len(batch)))
        assert_same_decode(eager, compiled)
    keys = step_keys(fast_model)
    assert keys and all(key[key[0] == "cache_write"] == "FastDLLMV2Strategy" for key in keys)
    assert any(key[0] == "cache_write" for key in keys) == ("do_sample" not in params)
    assert all(state.steps.graphs(key) == 1 for state in static_states(fast_model) for key in state.steps.keys)


@pytest.mark.parametrize("fuse", fast_first([False, True]))
def test_ar_on_a_right_shifted_model(fast_model, fuse):
    """AR on a right-shifted model (every AR checkpoint): with fused writes each step stores the last token and
    predicts the next (the compiled step returns the new carry); with `fuse_cache_write=False` every token comes
    from the carry of a compiled cache write (no denoising step). The eager runtime's tokens and counters, a
    left-padded batch and (separate writes) batch 1."""
    clear_static_state(fast_model)
    params = dict(decoding_strategy="ar", block_size=1, fuse_cache_write=fuse, max_new_tokens=10)
    prompts = [[5, 17, 42, 8, 9, 10, 11, 12, 13, 14], *PROMPTS[1:]]
    for batch in (prompts, prompts[:1]) if not fuse else (prompts,):
        eager = generate(fast_model, batch, **params)
        compiled = generate(fast_model, batch, cache_implementation="static", compile_config=cpu_compile_config(),
                            **params)
        assert_same_decode(eager, compiled)
    assert {key[0] for key in step_keys(fast_model)} == {"ARStrategy" if fuse else "cache_write"}
    assert all(state.steps.graphs(key) == 1 for state in static_states(fast_model) for key in state.steps.keys)


@pytest.mark.parametrize("params", fast_first([{}, dict(SAMPLED, generator="rows"), dict(SAMPLED, generator="shared")]))
def test_one_host_read_per_step(sdar_model, step_syncs, params):
    """Batch 1, greedy and seeded: between the first and the last denoising step the loop reads the device once per
    step (the step's read; the noise drawn before the step reads nothing). Inside the compiled step nothing reads
    it: `fullgraph=True` compiles no host read (each one would be a graph break), and the counter (a
    `TorchFunctionMode`, which dynamo would trace into the step) is paused there."""
    clear_static_state(sdar_model)      # count its own graphs only (conftest.cpu_compile_config)
    generate(sdar_model, PROMPTS[:1], max_new_tokens=16, cache_implementation="static",
             compile_config=cpu_compile_config(), **seeded(params, 1))
    with step_syncs.counting() as syncs:
        generate(sdar_model, PROMPTS[:1], max_new_tokens=16, cache_implementation="static",
                 compile_config=cpu_compile_config(), **seeded(params, 1))
    assert len(step_syncs.before) > 4
    assert step_syncs.per_step() == 1.0, syncs.by_site.most_common(4)
    assert all(state.steps.graphs(key) == 1 for state in static_states(sdar_model) for key in state.steps.keys)


def test_other_processors_run_the_eager_step(sdar_model, monkeypatch):
    """A processor outside the position-independent warpers: the eager step."""
    monkeypatch.setattr(block_diffusion, "denoising_step", None)         # would fail if called
    clear_static_state(sdar_model)
    torch.manual_seed(0)
    generate(sdar_model, PROMPTS[:1], max_new_tokens=8, cache_implementation="static",
             compile_config=cpu_compile_config(), do_sample=True, sequence_bias={(5,): 1.0})
    assert step_keys(sdar_model) == []


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("cc") is None,
                    reason="torch.compile (inductor) needs a C++ compiler on the CPU")
def test_inductor_compiled_step_gives_the_eager_tokens():
    """The bundled SDAR model (its first two layers), inductor (transformers' default backend), a left-padded batch
    of 2, seeded (per-row generators, warpers: the greedy step's operations and more; S2D2's and DEER's inductor tests
    run greedy): the eager runtime's tokens and counters."""
    tokenizer, model = load_first_layers("sdar-tiny-arith")
    enc = tokenizer(["12+7=", "3*4+25="], return_tensors="pt", padding=True)
    common = dict(decoding_strategy="block_diffusion", max_new_tokens=8, return_dict_in_generate=True,
                  attention_mask=enc.attention_mask)
    inductor = cpu_compile_config("inductor")
    sampled = dict(common, do_sample=True, temperature=0.8, top_k=20, top_p=0.95)
    rows = lambda: [torch.Generator().manual_seed(5), torch.Generator().manual_seed(6)]      # noqa: E731
    eager = model.generate(enc.input_ids, generator=rows(), **sampled)
    compiled = model.generate(enc.input_ids, cache_implementation="static", compile_config=inductor,
                              generator=rows(), **sampled)
    assert_same_decode(eager, compiled)
    assert step_keys(model)


# -- streaming (issue 34, phase 4): batch 1 with a streamer, the step's read carries what it shows ------------------
STREAMED = {
    "drafts": dict(),
    "no-drafts": dict(drafts=False),
    "seeded-drafts": dict(SAMPLED, generator="rows"),
    "sub-blocks": dict(sub_block_size=2, confidence_threshold=0.5, generator="shared", do_sample=True, top_k=5),
    "ar": dict(decoding_strategy="ar", block_size=1, max_new_tokens=8),
}


@pytest.mark.parametrize("case", fast_first(list(STREAMED)))
def test_streaming_equals_the_eager_runtime(sdar_model, case):
    """Batch 1 with a streamer, compiled: the streamer receives exactly the eager runtime's calls (`put` of the final
    tokens after each step and each finished block, `put_draft` of the argmax canvas before each commit, `end`), the
    draft canvas and the block's first mask coming from the step's one read; tokens and counters equal too. A
    streamer with and without `put_draft`, greedy and seeded, sub-blocks, AR (no drafts)."""
    clear_static_state(sdar_model)
    params = {"max_new_tokens": 16, **STREAMED[case]}
    drafts = params.pop("drafts", True)
    eager_streamer, compiled_streamer = Recorder(drafts), Recorder(drafts)
    eager = generate(sdar_model, PROMPTS[:1], streamer=eager_streamer, **seeded(params, 1))
    compiled = generate(sdar_model, PROMPTS[:1], streamer=compiled_streamer,
                        cache_implementation="static", compile_config=cpu_compile_config(), **seeded(params, 1))
    assert_same_decode(eager, compiled)
    assert compiled_streamer.events == eager_streamer.events
    kinds = [event[0] for event in eager_streamer.events]
    assert kinds[-1] == "end" and kinds.count("put") > 2
    assert ("draft" in kinds) == (drafts and case != "ar")
    assert step_keys(sdar_model)
    assert all(state.steps.graphs(key) == 1 for state in static_states(sdar_model) for key in state.steps.keys)


@pytest.mark.slow
def test_streaming_with_token_editing_and_right_shifted_models(llada2_model, fast_model):
    """LLaDA2.1 token editing (final tokens only when a block ends, drafts before each step) and Fast-dLLM v2
    (right-shifted, separate writes, sub-blocks): the eager runtime's streamer calls, tokens and counters."""
    cases = [(llada2_model, dict(decoding_strategy="llada2", confidence_threshold=0.5, editing_threshold=0.3)),
             (fast_model, dict(decoding_strategy="fast_dllm_v2", block_size=8, sub_block_size=2, max_new_tokens=20))]
    for model, params in cases:
        clear_static_state(model)
        eager_streamer, compiled_streamer = Recorder(), Recorder()
        eager = generate(model, PROMPTS[:1], streamer=eager_streamer, **params)
        compiled = generate(model, PROMPTS[:1], streamer=compiled_streamer, cache_implementation="static",
                            compile_config=cpu_compile_config(), **params)
        assert_same_decode(eager, compiled)
        assert compiled_streamer.events == eager_streamer.events
        assert "draft" in [event[0] for event in eager_streamer.events]
        assert step_keys(model)


@pytest.mark.slow
def test_streaming_one_host_read_per_step(sdar_model, step_syncs, monkeypatch):
    """Batch 1 with a streamer taking drafts: still one host read per step (the step's read, widened by the first
    mask and the draft canvas), none for the stream (it gets host tensors built from that read)."""
    stream_on_the_host(monkeypatch, step_syncs)
    clear_static_state(sdar_model)
    common = dict(max_new_tokens=16, cache_implementation="static", compile_config=cpu_compile_config())
    generate(sdar_model, PROMPTS[:1], streamer=Recorder(), **common)
    with step_syncs.counting() as syncs:
        generate(sdar_model, PROMPTS[:1], streamer=Recorder(), **common)
    assert len(step_syncs.before) > 4
    assert step_syncs.per_step() == 1.0, syncs.by_site.most_common(6)
