"""A CUDA graph stood in for on the CPU: a capture records the ATen operations a function runs (a tape), and a
replay runs the tape again, not the Python.

What makes it a faithful stand-in for `torch.cuda.graph` (PyTorch "CUDA Graphs", constraints of captured code):

- **No Python on replay.** A replay re-executes the recorded operations with the same Python arguments (shapes,
  scalars, branches taken at capture): Python state read or changed by the function is what it was at capture.
- **Fixed addresses.** A tensor made before the capture is read at its address, with whatever it holds at replay;
  tensors made during the capture are made again by the replay. Reading one made before that is neither a graph
  buffer (the function's arguments), a weight of a registered model nor its static cache is refused: after
  the call that captured, a real graph would read freed memory, or the stale value of an attribute since replaced.
- **Refused at capture:** host reads (`.item()`, `nonzero`, `tolist`...: a sync inside a capture raises on CUDA),
  random draws (a graph replays the generator offsets it recorded, not the call's generators), and writes into the
  graph's buffers (the caller's tensor would stay unchanged on replay, where an eager or compiled step changes it).
  A host scalar (a 0-dim CPU tensor, `x[..., :2] = 1`) may be read by a fill: PyTorch fills with its value, no copy.

These refusals raise `AssertionError` from the capture (a test failure, not a capture failure the runtime would
recover from). :class:`ReplayedGraphs` is the runtime's `CapturedForwards` with its CUDA calls replaced by a tape,
installed by the `replayed_graphs` fixture (conftest).
"""

from __future__ import annotations

import contextlib
import traceback

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map

import hf_dllm_spec.runtime.graphs as graphs_runtime
import hf_dllm_spec.runtime.static as static_runtime
from hf_dllm_spec.runtime.graphs import CapturedForwards

#: Operations that read a device value on the host (or whose output shape depends on one).
HOST_READS = {"aten::_local_scalar_dense", "aten::item", "aten::nonzero", "aten::nonzero_static", "aten::is_nonzero",
              "aten::equal", "aten::masked_select", "aten::_unique2", "aten::unique_dim", "aten::unique_consecutive",
              "aten::allclose"}
#: The profiler range around a replay (benchmarks/host_work.py counts the operations outside it).
REPLAY_REGION = "CUDA graph replay (stand-in)"
#: Indexing operations that read the device on the host when an index is a boolean mask (`x[mask]`).
MASK_INDEXING = {"aten::index", "aten::index_put", "aten::index_put_", "aten::_index_put_impl_"}
#: Name parts of random operations.
RANDOM = ("rand", "bernoulli", "exponential", "normal", "multinomial", "uniform", "random_", "poisson", "geometric",
          "cauchy", "log_normal", "dropout")


def storage(tensor: torch.Tensor) -> int:
    """The address of `tensor`'s storage (0 for an empty one)."""
    return tensor.untyped_storage().data_ptr()


class Tape(TorchDispatchMode):
    """Records the operations run inside it; refuses what a CUDA graph capture cannot hold.

    Args:
        buffers (`list[torch.Tensor]`): the graph's input buffers (read, never written).
        persistent (`set[int]`): storages that outlive every graph: the registered models' weights and caches.
    """

    def __init__(self, buffers: list[torch.Tensor], persistent: set[int]) -> None:
        super().__init__()
        self.buffers = {storage(b) for b in buffers}
        self.allowed = self.buffers | persistent | {0}
        self.made: set[int] = set()
        self.records: list[tuple] = []
        self.problems: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._schema.name
        if name in HOST_READS or (name in MASK_INDEXING and any(
                isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in tree_leaves(args[1:2]))):
            self._problem(f"{name} reads the device on the host")
        if any(part in name for part in RANDOM):
            self._problem(f"{name} draws random numbers")
        inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        for t in inputs:
            scalar = t.dim() == 0 and t.device.type == "cpu" and name.startswith(("aten::fill", "aten::lift_fresh"))
            if storage(t) not in self.made and storage(t) not in self.allowed and not scalar:
                self._problem(f"{name} reads a {tuple(t.shape)} {t.dtype} tensor made before the capture "
                              "that is neither an argument, a weight nor the static cache")
        for schema, value in zip(func._schema.arguments, args):
            written = schema.alias_info is not None and schema.alias_info.is_write
            if written and isinstance(value, torch.Tensor) and storage(value) in self.buffers:
                self._problem(f"{name} writes into an argument of the captured function")
        out = func(*args, **kwargs)
        seen = {storage(t) for t in inputs}
        self.made.update(storage(t) for t in tree_leaves(out) if isinstance(t, torch.Tensor) and storage(t) not in seen)
        self.records.append((func, args, kwargs, out))
        return out

    def _problem(self, text: str) -> None:
        """Record `text` with the innermost line of the project's code that ran it."""
        frames = [f for f in traceback.extract_stack() if "hf_dllm_spec" in f.filename or "model_patches" in f.filename]
        where = f" ({frames[-1].filename.rsplit('/', 2)[-1]}:{frames[-1].lineno} {frames[-1].name})" if frames else ""
        self.problems.append(text + where)

    def check(self) -> None:
        """Raise `AssertionError` listing what the capture could not hold (each distinct problem once)."""
        assert not self.problems, "not capturable: " + "; ".join(dict.fromkeys(self.problems))

    def replay(self, output, offset: float = 0.0) -> None:
        """Run the recorded operations again and copy their results into `output` (the capture's outputs, a tensor
        or a tuple of tensors / None), floating ones plus `offset` (a corrupt graph)."""
        made: dict[int, torch.Tensor] = {}

        def now(value):
            return made.get(id(value), value) if isinstance(value, torch.Tensor) else value

        for func, args, kwargs, out in self.records:
            new = func(*tree_map(now, args), **tree_map(now, kwargs))
            for old, fresh in zip(tree_leaves(out), tree_leaves(new)):
                if isinstance(old, torch.Tensor):
                    made[id(old)] = fresh
        for static in tree_leaves(output):
            if isinstance(static, torch.Tensor) and id(static) in made:
                replayed = made[id(static)]
                static.copy_(replayed + offset if static.is_floating_point() else replayed)


def persistent_storages(runners) -> set[int]:
    """The storages of the runners' models' weights and buffers and of their static caches."""
    found = set()
    for runner in runners:
        found.update(storage(t) for t in (*runner.model.parameters(), *runner.model.buffers()))
        for layer in runner.cache.layers:
            found.update(storage(t) for t in (getattr(layer, "keys", None), getattr(layer, "values", None))
                         if isinstance(t, torch.Tensor))
    return found


class DeviceRecorder:
    """Stands for `hf_dllm_spec.runtime.graphs.device_guard`: remembers the devices entered, innermost last."""

    def __init__(self) -> None:
        self.stack: list[torch.device] = []

    @contextlib.contextmanager
    def __call__(self, device):
        self.stack.append(torch.device(device))
        try:
            yield
        finally:
            self.stack.pop()

    def check(self, device) -> None:
        assert self.stack and self.stack[-1] == torch.device(device), \
            f"CUDA graph work outside the model's device {device} (current: {self.stack})"


GUARD = DeviceRecorder()


_REAL_RUN = CapturedForwards.run


class ReplayedGraphs(CapturedForwards):
    """`CapturedForwards` with its CUDA calls replaced: the warm-up runs eagerly, a capture records the function's
    operations on the static buffers (:class:`Tape`: refusing host reads, random draws, writes into its buffers and
    tensors read that a graph would read stale) and a replay runs that tape again into the static outputs, without
    the Python. Everything else (keys, LRU, buffers, copies, write columns, counts, the check of the first replay,
    failures and retries) is the real code. Each replaced call checks that it runs under the model's device
    (`device_guard`). :func:`install` also gives these methods to the tables made before it (kept on the models
    by earlier calls), so the settings and counts below are the class's."""

    fail = False            # every capture raises
    corrupt = False         # replays return other numbers (bitsandbytes#1308)
    capture_calls = 0
    step_captures = 0       # decoding steps captured (`StaticModelRunner.run_step`), not plain forwards
    runners: list = []      # the static runners made meanwhile (their weights and caches outlive a graph)

    def run(self, key, *args, **kwargs):
        known = key in self.graphs
        out = _REAL_RUN(self, key, *args, **kwargs)
        ReplayedGraphs.step_captures += key[0] == "step" and not known and key in self.graphs
        return out

    def _warm_up(self, run_forward, buffers):
        GUARD.check(self.device)
        for _ in range(self.WARMUP_RUNS):
            out = run_forward(*buffers)
        return out

    def _capture(self, run_forward, buffers):
        GUARD.check(self.device)
        ReplayedGraphs.capture_calls += 1
        if ReplayedGraphs.fail:
            raise RuntimeError("operation not permitted when stream is capturing\nmore")
        tape = Tape(buffers, persistent_storages(ReplayedGraphs.runners))
        with tape:
            output = run_forward(*buffers)
        tape.check()

        def replay():
            GUARD.check(self.device)
            with torch.profiler.record_function(REPLAY_REGION):
                tape.replay(output, offset=1.0 if ReplayedGraphs.corrupt else 0.0)
        return replay, output


def install(monkeypatch) -> None:
    """Run the static runtime in its "cuda_graph" mode on the CPU (every model), its graphs stood in for by
    :class:`ReplayedGraphs` (the tables made before too); the runners made meanwhile are registered (their weights
    and caches outlive a graph)."""
    runners = []
    made = static_runtime.StaticModelRunner.__init__

    def register(self, *args, **kwargs):
        made(self, *args, **kwargs)
        runners.append(self)

    monkeypatch.setattr(static_runtime.StaticModelRunner, "__init__", register)
    monkeypatch.setattr(static_runtime, "CapturedForwards", ReplayedGraphs)
    for name in ("run", "_warm_up", "_capture"):
        monkeypatch.setattr(CapturedForwards, name, ReplayedGraphs.__dict__[name])
    monkeypatch.setattr(static_runtime, "compile_plan", lambda model, config: ("cuda_graph", ""))
    monkeypatch.setattr(graphs_runtime, "device_guard", GUARD)
    monkeypatch.setattr(ReplayedGraphs, "capture_calls", 0)
    monkeypatch.setattr(ReplayedGraphs, "step_captures", 0)
    monkeypatch.setattr(ReplayedGraphs, "runners", runners)
