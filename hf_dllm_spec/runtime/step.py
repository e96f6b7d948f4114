"""Compiled decoding steps: one decoding step (the forward and the step's maths) as one `torch.compile`d function.

With `cache_implementation="static"` and a `compile_config`, the static runtime compiles the model call only;
every tensor operation around it (the runner's input preparation, the logits alignment, the step's rules) then
runs eagerly, each one a kernel launch on a GPU. A strategy whose step is a function of tensors hands that function
to the runner (:meth:`~hf_dllm_spec.runtime.static.StaticModelRunner.run_step`), which runs it through
:class:`CompiledSteps`: the whole step, forward included, is one compiled function, and the host reads one tensor
per step.

Keys. A step is compiled once per key: the strategy's own key (its rule and parameters) plus the fixed shapes of
the step's forward, `(rows bucket, width, kept logits, attended prefix, cache length, cache rows)`. Each key gets
its own copy of the function's code object, so its compiled graph has its own cache entry: keys never count
against one another in dynamo's recompile limit, and a recompilation inside one key (a guard that failed) is a bug
that `torch._dynamo.config.error_on_recompile` turns into an error (tests/test_compiled_step.py).

Options: `compile_config`'s `backend`, `mode`, `dynamic` and `options` (transformers' meaning), always with
`fullgraph=True`: a graph break inside a step raises instead of silently splitting the step into eager pieces.
`dynamic=None` (the config's default) compiles static shapes (`dynamic=False`): every key is one fixed shape, and
torch's default would mark sizes dynamic from a call's second key on (its automatic-dynamic record is per source
line, which the keys' copies of one function share), tracing symbolic shapes for graphs that never see another.

Source: issue 34; transformers `DiffusionGemmaGenerationMixin._compile_functions` (compiles its sampler and
stopping criteria with the model); PyTorch `torch.compile` (`fullgraph`, guards and recompilation).
"""

from __future__ import annotations

import types
from typing import Any, Callable

import torch

#: The `CompileConfig` fields passed to `torch.compile` (`fullgraph` is always True here).
COMPILE_OPTIONS = ("backend", "mode", "dynamic", "options")


def compile_options(compile_config, *, fullgraph: bool = True) -> dict[str, Any]:
    """`torch.compile` keyword arguments from a transformers `CompileConfig` (None: torch's defaults), with
    `fullgraph` (True for a decoding step: a graph break is a bug; a plain forward takes the config's own) and
    `dynamic=False` unless the config asks for dynamic shapes (each key compiles one fixed shape)."""
    options = {name: getattr(compile_config, name) for name in COMPILE_OPTIONS
               if getattr(compile_config, name, None) is not None}
    return {"dynamic": False, **options, "fullgraph": fullgraph}


def _own_code(function: Callable) -> Callable:
    """A copy of `function` with its own code object (dynamo keeps compiled graphs per code object)."""
    copy = types.FunctionType(function.__code__.replace(), function.__globals__, function.__name__,
                              function.__defaults__, function.__closure__)
    copy.__kwdefaults__ = function.__kwdefaults__
    copy.__qualname__ = function.__qualname__
    return copy


class CompiledSteps:
    """The compiled steps of one model and role, one per key (kept across `generate` calls)."""

    def __init__(self) -> None:
        self._steps: dict[tuple, Callable] = {}
        self._code: dict[tuple, types.CodeType] = {}

    def __contains__(self, key: tuple) -> bool:
        return key in self._steps

    def run(self, key: tuple, function: Callable, options: dict[str, Any], *args) -> Any:
        """`function(*args)` compiled for `key` (on its first use, with `torch.compile(**options)`).

        Args:
            key (`tuple`): hashable; everything the compiled graph specialises on (shapes, the strategy's
                parameters).
            function (`Callable`): a plain function (not a bound method: the strategy and the runner are
                arguments, so the next call's objects reuse the graph).
            options (`dict`): from :func:`compile_options`.
        """
        step = self._steps.get(key)
        if step is None:
            own = _own_code(function)
            self._code[key] = own.__code__
            step = self._steps[key] = torch.compile(own, **options)
        return step(*args)

    def graphs(self, key: tuple) -> int:
        """The graphs dynamo compiled for `key`'s step (its cache entries): 1, or more after a recompilation."""
        from torch._dynamo.eval_frame import _debug_get_cache_entry_list       # dynamo's own accessor (tests)

        return len(_debug_get_cache_entry_list(self._code[key]))

    @property
    def keys(self) -> list[tuple]:
        """The keys compiled so far."""
        return list(self._steps)

    def clear(self) -> None:
        """Drop every compiled step (the buffers they were compiled against were reallocated)."""
        self._steps.clear()
        self._code.clear()


__all__ = ["COMPILE_OPTIONS", "CompiledSteps", "compile_options"]
