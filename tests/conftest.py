"""Shared fixtures: tiny models built from config (fp32, CPU), once per session."""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import gc
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import warnings

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# transformers copies `trust_remote_code` modules into one cache folder, truncating and rewriting each file, with
# only a thread lock: each pytest process (an xdist worker) gets its own, so no worker imports a half-written copy
if "HF_MODULES_CACHE" not in os.environ:
    os.environ["HF_MODULES_CACHE"] = tempfile.mkdtemp(prefix="hf-dllm-spec-modules-")
    atexit.register(shutil.rmtree, os.environ["HF_MODULES_CACHE"], True)

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

import hf_dllm_spec
from hf_dllm_spec.integration.rows import RowFeed, RowRequest
from hf_dllm_spec.runtime.runner import ModelRunner
from model_patches.sdar import SDARConfig, SDARForCausalLM

hf_dllm_spec.register_auto_classes()
ModelRunner.check_layouts = True      # every forward of the suite checks its layout (off by default: a host sync)
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)          # pytest -n N: the workers share the cores; one intra-op thread each

MASK_ID = 98
TINY = dict(vocab_size=99, hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, max_position_embeddings=256, initializer_range=0.2,
            eos_token_id=None, bos_token_id=None, pad_token_id=None, attn_implementation="sdpa")


@pytest.fixture(scope="module")
def one_thread():
    """Tiny forwards run ~10x faster on one intra-op thread (thread wake-ups dominate on a busy CPU); restored."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def as_users_run_it(monkeypatch, one_thread):
    """Layout checks off (the suite turns them on; they read the device every storing forward, so a compiled step
    is not used with them), one intra-op thread."""
    monkeypatch.setattr(ModelRunner, "check_layouts", False)


@pytest.fixture
def replayed_graphs(monkeypatch):
    """The static runtime's "cuda_graph" mode on the CPU, capture and replay stood in for by a tape
    (:mod:`graph_tape`)."""
    import graph_tape

    graph_tape.install(monkeypatch)


class StepSyncs:
    """Host synchronisations counted before each compiled step (`StaticModelRunner.run_step`) of the calls made
    inside :meth:`counting`; paused inside the compiled call (the counter is a `TorchFunctionMode`, which dynamo would
    trace into; `fullgraph=True` already proves there is no host read inside). Steps outside :meth:`counting` (a
    first call that compiles) are not counted."""

    def __init__(self, monkeypatch) -> None:
        from hf_dllm_spec.runtime.static import StaticModelRunner

        self.before: list[int] = []
        self.syncs = None
        run = StaticModelRunner.run_step

        def counted(runner, *args, **kwargs):
            if self.syncs is not None:
                self.before.append(self.syncs.total)
            with self.paused():
                return run(runner, *args, **kwargs)

        monkeypatch.setattr(StaticModelRunner, "run_step", counted)

    @contextlib.contextmanager
    def paused(self):
        """Leave what runs inside out of the count (a compiled call, the stream's own work on host tensors); a
        no-op outside :meth:`counting`."""
        syncs = self.syncs
        if syncs is None:
            yield
            return
        syncs.__exit__(None, None, None)
        try:
            yield
        finally:
            syncs.__enter__()

    @contextlib.contextmanager
    def counting(self):
        from hf_dllm_spec.runtime.syncs import count_host_syncs

        with count_host_syncs() as self.syncs:
            yield self.syncs
        self.syncs = None

    def per_step(self) -> float:
        """Host reads per compiled step, between the first counted step and the last."""
        return (self.before[-1] - self.before[0]) / (len(self.before) - 1)


@pytest.fixture
def step_syncs(monkeypatch) -> StepSyncs:
    return StepSyncs(monkeypatch)


#: `SpecDecodingStats` fields that are times or notes (they differ between runs), left out of counter comparisons.
TIME_FIELDS = {"wall_time_s", "prefill_time_s", "forward_time_s", "draft_model_time_s", "warmup_time_s", "runtime"}


def spec_counters(stats) -> dict:
    """A row's counters (`SpecDecodingStats` fields but :data:`TIME_FIELDS`)."""
    return {f.name: getattr(stats, f.name) for f in dataclasses.fields(stats) if f.name not in TIME_FIELDS}


def assert_same_decode(expected, got) -> None:
    """Two `return_dict_in_generate` outputs: the same sequences, per-row counters and forward calls."""
    assert got.sequences.tolist() == expected.sequences.tolist()
    for a, b in zip(expected.spec_stats_per_row, got.spec_stats_per_row):
        assert spec_counters(b) == spec_counters(a)
    assert got.spec_stats.num_forward_calls == expected.spec_stats.num_forward_calls


class ScriptedFeed(RowFeed):
    """Hands out `joining[k]` at the k-th join point (1-based); counts the join points."""

    def __init__(self, initial: list[RowRequest], joining: dict[int, list[RowRequest]]) -> None:
        super().__init__(initial)
        self.joining, self.calls = joining, 0

    def take(self, rows: int) -> list[RowRequest]:
        self.calls += 1
        return self.joining.pop(self.calls, [])


def fast_first(cases: list, fast: int = 1) -> list:
    """Parametrisation `cases` whose first `fast` cases run in the fast tier (every supported transformers version,
    `-m "not slow"`) and the others only in the full suite (`slow`): the compiled-step equality tests, whose cases
    each compile their own graphs, keep CI within its time. A tuple case fills several names."""
    return [case if i < fast else pytest.param(*(case if isinstance(case, tuple) else (case,)), marks=pytest.mark.slow)
            for i, case in enumerate(cases)]


def cpu_compile_config(backend: str = "eager"):
    """transformers' `CompileConfig` with `backend` (dynamo's "eager": the trace and its guards, fast; "inductor":
    generated code), compiling on the CPU too (`_compile_all_devices`, transformers' switch).

    A compiled step's graph guards on transformers' output-capturing registry (`_CAN_RECORD_REGISTRY`, one entry per
    model class instantiated in the process), so each key recompiles once after a model of a new class is loaded:
    a test that counts graphs per key clears the model's static state first and counts its own keys only."""
    from transformers import CompileConfig

    config = CompileConfig(backend=backend, mode=None if backend == "eager" else "default")
    config._compile_all_devices = True
    return config


def load_first_layers(name: str, layers: int = 2):
    """The bundled model `models/<name>` cut to its first `layers` decoder layers (`num_hidden_layers` and
    `layer_types`, which caches read; the other layers' weights are not loaded), and its tokenizer with left padding,
    for the compiled-step tests: dynamo traces the forward once per compiled key, so compiling costs about layers in
    proportion (S2D2 on sdar-tiny-arith, a batch of 2, 16 tokens, 4 keys: 16.3 s with its 4 layers, 9.7 s with 2).
    The trained embeddings and first layers keep the drafts structured enough for verification to accept some and
    reject others."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging

    from hf_dllm_spec.tools.jobs.evaluation import ROOT

    path = ROOT / "models" / name
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.padding_side = "left"
    config = AutoConfig.from_pretrained(path)
    config.num_hidden_layers = layers
    if getattr(config, "layer_types", None) is not None:        # transformers 5.17's DynamicCache: one per entry
        config.layer_types = config.layer_types[:layers]
    verbosity = logging.get_verbosity()
    logging.set_verbosity_error()               # the load report lists the layers left out
    try:
        model = AutoModelForCausalLM.from_pretrained(path, config=config, dtype=torch.float32).eval()
    finally:
        logging.set_verbosity(verbosity)
    return tokenizer, model


@pytest.fixture(scope="session")
def sdar_model() -> SDARForCausalLM:
    """Tiny random SDAR model (block size 4, mask 98). Large init so logits are peaked, not near-ties."""
    torch.manual_seed(0)
    return SDARForCausalLM(SDARConfig(block_size=4, mask_token_id=MASK_ID, **TINY)).eval()


@pytest.fixture(scope="session")
def qwen_model(sdar_model) -> Qwen3ForCausalLM:
    """A plain transformers Qwen3 model with the same weights as `sdar_model` and no mask token in its config.

    SDAR weights in the Qwen3 layout: declared position-aligned (a plain Qwen checkpoint is right-shifted).
    """
    model = Qwen3ForCausalLM(Qwen3Config(**TINY, dllm_alignment="position")).eval()
    model.load_state_dict(sdar_model.state_dict())
    return model


LLADA2_TINY = dict(vocab_size=99, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=8, num_experts=8, num_experts_per_tok=2, num_shared_experts=1,
                   moe_intermediate_size=16, n_group=2, topk_group=1, max_position_embeddings=256, rope_theta=10000.0,
                   partial_rotary_factor=0.5, initializer_range=0.2, eos_token_id=None, pad_token_id=None,
                   attn_implementation="sdpa")


def tiny_family_models() -> dict:
    """Tiny random models of every family, seeded: "sdar" and "sdar_drafter" (block size 4), "fast" (Fast-dLLM v2,
    bd_size 8), "llada2" (block size 4), "qwen" (Qwen3, an AR target); mask token 98, float32."""
    from model_patches.fast_dllm_v2 import Fast_dLLM_QwenConfig, Fast_dLLM_QwenForCausalLM
    from model_patches.llada2 import LLaDA2MoeConfig, LLaDA2MoeModelLM

    torch.manual_seed(0)
    sdar = SDARForCausalLM(SDARConfig(block_size=4, mask_token_id=MASK_ID, **TINY)).eval()
    torch.manual_seed(1)
    sdar_drafter = SDARForCausalLM(SDARConfig(block_size=4, mask_token_id=MASK_ID, **TINY)).eval()
    torch.manual_seed(2)
    fast = Fast_dLLM_QwenForCausalLM(Fast_dLLM_QwenConfig(bd_size=8, mask_token_id=MASK_ID, **TINY)).eval()
    torch.manual_seed(3)
    llada2 = LLaDA2MoeModelLM(LLaDA2MoeConfig(block_size=4, mask_token_id=MASK_ID, **LLADA2_TINY)).eval()
    torch.manual_seed(4)
    qwen = Qwen3ForCausalLM(Qwen3Config(**TINY)).eval()
    return {"sdar": sdar, "sdar_drafter": sdar_drafter, "fast": fast, "llada2": llada2, "qwen": qwen}


@pytest.fixture(scope="session")
def llada2_model():
    """Tiny random LLaDA2 MoE (block size 4, mask 98; 8 experts in 2 groups, top-2 of 1 group, a shared expert)."""
    from model_patches.llada2 import LLaDA2MoeConfig, LLaDA2MoeModelLM

    torch.manual_seed(0)
    model = LLaDA2MoeModelLM(LLaDA2MoeConfig(block_size=4, mask_token_id=MASK_ID, **LLADA2_TINY)).eval()
    for layer in model.model.layers[1:]:
        layer.mlp.gate.e_score_correction_bias.normal_(0, 0.1)     # the bias changes choices, as on the Hub
    return model


@pytest.fixture
def prompt() -> torch.Tensor:
    """A 7-token prompt: one full block of 4 is prefilled, 3 tokens share the first generation block."""
    return torch.tensor([[5, 17, 42, 8, 23, 61, 4]])


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def left_padded_batch(lengths, seed: int = 1, high: int = 90):
    """Random prompts of the given lengths, left-padded with 0: `(ids (N, P), attention_mask (N, P), prompts)`."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(1, high, (n,), generator=g) for n in lengths]
    width = max(lengths)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):], mask[i, width - len(p):] = p, 1
    return ids, mask, prompts


def run_torchrun(script, *args: str, timeout: int) -> subprocess.CompletedProcess:
    """`torchrun --standalone --nproc_per_node 2 script *args` on the CPU (one thread per rank, offline, the repository
    importable), holding a lock file: parallel test workers start one torchrun job at a time (two at once contend for
    the CPU cores and their rendezvous).

    Each rank runs with Python's fault handler, so a rank that dies of a signal prints its Python stack. Such a death
    (seen once in CI: rank 0 killed by SIGSEGV inside a tensor-parallel job, not reproduced in 26 local runs, its
    stack not kept) reruns the job once, with a warning that carries the first run's crash report
    (:func:`crash_report`); a second death, or any other failure, is returned as it is."""
    from filelock import FileLock

    root = pathlib.Path(__file__).resolve().parents[1]
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", PYTHONPATH=str(root), PYTHONFAULTHANDLER="1")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(script),
               *args]
    with FileLock(str(pathlib.Path(tempfile.gettempdir()) / "hf-dllm-spec-torchrun.lock")):
        done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=root, timeout=timeout)
        if done.returncode != 0 and "received by PID" in done.stderr:              # a rank died of a signal
            warnings.warn(f"torchrun: a rank died of a signal; rerunning once. {crash_report(done)}")
            done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=root, timeout=timeout)
    return done


def crash_report(done: subprocess.CompletedProcess, tail: int = 3000) -> str:
    """What a failed torchrun job printed that says why: each crashed rank's fault-handler stack (from "Fatal Python
    error" to its list of extension modules) and the last `tail` characters of the job's standard error."""
    stacks = [block.split("\nExtension modules")[0][:4000] for block in done.stderr.split("Fatal Python error")[1:]]
    return "".join(f"Fatal Python error{stack}\n---\n" for stack in stacks) + (done.stderr[-tail:] if tail else "")


class Recorder:
    """A streamer that records its calls: `put` (committed tokens), `put_draft` (transformers'
    `TextDiffusionStreamer` protocol; left out with `drafts=False`, a plain `TextStreamer`), `end`."""

    def __init__(self, drafts: bool = True) -> None:
        self.events: list[tuple] = []
        if not drafts:
            self.put_draft = None

    def put(self, value: torch.Tensor) -> None:
        self.events.append(("put", value.reshape(-1).tolist()))

    def put_draft(self, value: torch.Tensor) -> None:
        assert value.dim() == 2 and value.shape[0] == 1
        self.events.append(("draft", value[0].tolist()))

    def end(self) -> None:
        self.events.append(("end", None))


def stream_on_the_host(monkeypatch, step_syncs) -> None:
    """The stream's own work (a `TokenStream` cutting and copying the final tokens it is given, `stream_draft`
    checking a draft for a stop id) is done on host tensors that the strategy builds from the step's read: checked
    here (every tensor a strategy hands to the stream is on the CPU), and left out of `step_syncs`' count (the counter
    sees every `tolist` / `cpu` / `bool`, of host tensors too)."""
    from hf_dllm_spec.strategies.base import DecodingStrategy
    from hf_dllm_spec.strategies.streaming import TokenStream

    def paused(method):
        def call(self, *tensors):
            assert all(t.device.type == "cpu" for t in tensors)
            with step_syncs.paused():
                return method(self, *tensors)
        return call

    monkeypatch.setattr(TokenStream, "push", paused(TokenStream.push))
    monkeypatch.setattr(DecodingStrategy, "stream_draft", paused(DecodingStrategy.stream_draft))


def generator_states(generator) -> list[list[int]]:
    """The states of `generator` (one, a list of them, or None: none), as lists: two calls that drew the same
    numbers from generators seeded alike leave equal states."""
    generators = generator if isinstance(generator, (list, tuple)) else [] if generator is None else [generator]
    return [g.get_state().tolist() for g in generators]


def seeded(params: dict, rows: int) -> dict:
    """`params` with fresh seeded generators: `generator="shared"` one for the batch, `"rows"` one per row."""
    kind = params.get("generator")
    if kind == "shared":
        return {**params, "generator": torch.Generator().manual_seed(1234)}
    if kind == "rows":
        return {**params, "generator": [torch.Generator().manual_seed(100 + r) for r in range(rows)]}
    return params


@contextlib.contextmanager
def no_cyclic_garbage(label):
    """Fail if the calls inside leave tensors or objects of the library in reference cycles: such a call's objects,
    device memory included, stay allocated until Python's cyclic collector happens to run (on a GPU, memory that
    grows and falls from call to call: check-gpu's memory check saw it with S2D2's routing policies).

    The objects alive on entry are frozen (`gc.freeze`) for the block, so the collection at its end scans only the
    objects made inside it (a full collection of a test process's heap took 0.2-1.5 s, twice per use)."""
    gc.freeze()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        yield
        gc.collect()
        cyclic = [o for o in gc.garbage if isinstance(o, torch.Tensor)
                  or type(o).__module__.startswith(("hf_dllm_spec", "model_patches"))]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.unfreeze()
    assert not cyclic, f"{label}: left in reference cycles: {sorted({type(o).__qualname__ for o in cyclic})}"
