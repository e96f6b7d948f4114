"""The module paths of the flat layout before 0.1, which moved into rooms (docs/architecture.md).

An old path still imports: it resolves to the module at its new path (the same module object, so classes and
functions are identical) and warns once with a `DeprecationWarning` naming the new path. The old paths will be
removed in a later release.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

#: old module path -> new module path
MOVED = {
    "hf_dllm_spec.masks": "hf_dllm_spec.maths.masks",
    "hf_dllm_spec.unmasking": "hf_dllm_spec.maths.unmasking",
    "hf_dllm_spec.sampling": "hf_dllm_spec.maths.sampling",
    "hf_dllm_spec.routing": "hf_dllm_spec.maths.routing",
    "hf_dllm_spec.verification": "hf_dllm_spec.maths.verification",
    "hf_dllm_spec.editing": "hf_dllm_spec.maths.editing",
    "hf_dllm_spec.runner": "hf_dllm_spec.runtime.runner",
    "hf_dllm_spec.timing": "hf_dllm_spec.runtime.timing",
    "hf_dllm_spec.placement": "hf_dllm_spec.runtime.placement",
    "hf_dllm_spec.quantization": "hf_dllm_spec.runtime.quantization",
    "hf_dllm_spec.trace": "hf_dllm_spec.runtime.trace",
    "hf_dllm_spec.static_runtime": "hf_dllm_spec.runtime.static",
    "hf_dllm_spec.drafting": "hf_dllm_spec.strategies.drafting",
    "hf_dllm_spec.registry": "hf_dllm_spec.strategies.registry",
    "hf_dllm_spec.reference": "hf_dllm_spec.strategies.reference",
    "hf_dllm_spec.generation": "hf_dllm_spec.integration.generate",
    "hf_dllm_spec.mixin": "hf_dllm_spec.integration.mixin",
    "hf_dllm_spec.checks": "hf_dllm_spec.integration.checks",
    "hf_dllm_spec.streaming": "hf_dllm_spec.strategies.streaming",
    "hf_dllm_spec.candidate_generator": "hf_dllm_spec.integration.candidate_generator",
    "hf_dllm_spec.export": "hf_dllm_spec.hub.export",
    "hf_dllm_spec.evaluation": "hf_dllm_spec.jobs.evaluation",
}


class MovedModuleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Resolves the old module paths of :data:`MOVED` to their new modules (a `sys.meta_path` finder)."""

    def find_spec(self, fullname, path=None, target=None):
        return importlib.util.spec_from_loader(fullname, self) if fullname in MOVED else None

    def create_module(self, spec):
        new = MOVED[spec.name]
        warnings.warn(f"`{spec.name}` moved to `{new}`; import it from there (the old path will be removed in "
                      "a later release).", DeprecationWarning, stacklevel=2)
        return importlib.import_module(new)

    def exec_module(self, module) -> None:
        """Nothing to run: the module at the new path is already imported."""


def install() -> None:
    """Add the finder to `sys.meta_path` once."""
    if not any(isinstance(finder, MovedModuleFinder) for finder in sys.meta_path):
        sys.meta_path.append(MovedModuleFinder())
