"""How the families' model classes get `generate(decoding_strategy=...)` without importing a decoding library.

The dependency points one way: `hf_dllm_spec` (the decoding library) imports `model_patches` (the families),
never the reverse. The family classes inherit :class:`DllmGenerationMixin`, whose `generate` hands a call
that names a strategy (or a diffusion model's call that names none) to a **decoding backend**: a callable

    backend(model, args: tuple, kwargs: dict, decoding_strategy: str) -> torch.LongTensor | ModelOutput

found, on first use, among the callables registered with :func:`register_decoding_backend`, else through the
Python entry point group ``model_patches.decoding_backends`` (the `hf-dllm-spec` distribution declares
`hf_dllm_spec.integration.mixin:generate_with_strategy` there in its `pyproject.toml`, so an installed package
serves the family classes in a process that never imported it, e.g. a checkpoint loaded with
`trust_remote_code=True`).

A diffusion model never decodes with transformers' left-to-right sampling (which produces garbage on it):
without `decoding_strategy`, `generate` runs the strategy stored in the generation config under
:data:`GENERATION_CONFIG_KEY`, else the class's :attr:`DllmGenerationMixin.native_decoding_strategy`.
"""

from __future__ import annotations

import functools
import importlib.metadata
import inspect
from typing import Any, Callable, ClassVar

from transformers import GenerationMixin

#: Entry point group through which an installed decoding library serves the family classes' `generate`.
BACKEND_ENTRY_POINT_GROUP = "model_patches.decoding_backends"
#: The `GenerationConfig` attribute that stores a model's default strategy and its parameters (a dict with
#: `decoding_strategy` plus the strategy's parameters; written by `hf_dllm_spec.DecodingConfig`).
GENERATION_CONFIG_KEY = "dllm_decoding"

DecodingBackend = Callable[[Any, tuple, dict, str], Any]
_backends: list[DecodingBackend] = []


def register_decoding_backend(backend: DecodingBackend) -> None:
    """Make `backend` the decoding backend of the family classes (it takes precedence over entry points).

    Args:
        backend (`Callable`): `backend(model, args, kwargs, decoding_strategy)`, called by
            :meth:`DllmGenerationMixin.generate` with the positional and keyword arguments of the `generate` call.
    """
    if backend in _backends:
        _backends.remove(backend)
    _backends.insert(0, backend)


def decoding_backend() -> DecodingBackend:
    """The registered backend, else the first one the entry point group ``model_patches.decoding_backends`` names
    (loaded once and then registered).

    Raises:
        RuntimeError: if none is registered and no installed distribution declares one.
    """
    if not _backends:
        for entry_point in importlib.metadata.entry_points(group=BACKEND_ENTRY_POINT_GROUP):
            register_decoding_backend(entry_point.load())
            break
    if not _backends:
        raise RuntimeError(
            "`generate` of a diffusion model class needs a decoding backend, and none is installed: no "
            f"distribution declares one in the entry point group {BACKEND_ENTRY_POINT_GROUP!r}. Install the "
            "hf-dllm-spec package from its checkout (`pip install -e <checkout>`), or register a backend with "
            "`model_patches.generation.register_decoding_backend`."
        )
    return _backends[0]


@functools.cache
def _positional_names() -> tuple[str, ...]:
    """Stock `GenerationMixin.generate`'s positional parameters after `self` and `inputs`, in order."""
    parameters = inspect.signature(GenerationMixin.generate).parameters.values()
    return tuple(p.name for p in parameters if p.kind is p.POSITIONAL_OR_KEYWORD)[2:]


def positional_as_keywords(args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
    """A `generate` call's positional arguments after `inputs` as keywords, under stock
    `GenerationMixin.generate`'s names and order (`generation_config`, `logits_processor`, `stopping_criteria`,
    ...), so that whatever reads the call by name (the stored strategy, the checks) sees them.

    Args:
        args (`tuple`): the call's positional arguments (`inputs` first).
        kwargs (`dict`): its keyword arguments (not changed).

    Returns:
        `(args, kwargs)`: `(inputs,)` (or `()` without inputs, or with `None`) and the keywords with the others
        added.

    Raises:
        TypeError: as Python raises it, for more positional arguments than stock `generate` takes, or one also
            passed by keyword.
    """
    names = _positional_names()
    if len(args) - 1 > len(names):
        raise TypeError(f"generate() takes at most {len(names) + 1} positional arguments ({len(args)} were given)")
    if len(args) > 1:
        kwargs = dict(kwargs)
        for name, value in zip(names, args[1:]):
            if name in kwargs:
                raise TypeError(f"generate() got multiple values for argument {name!r}")
            kwargs[name] = value
    return (args[:1] if args and args[0] is not None else ()), kwargs


class DllmGenerationMixin(GenerationMixin):
    """`generate` of the families' diffusion model classes: the decoding backend's strategies, native by default.

    `generate(decoding_strategy=...)` runs that strategy. Without `decoding_strategy`, a diffusion model decodes
    as a diffusion model: the strategy stored in its `generation_config.dllm_decoding` (with the parameters
    stored there), else its family's native decoding (:attr:`native_decoding_strategy`), never transformers'
    left-to-right sampling. Every other argument is transformers' own (`streamer`, `assistant_model`,
    `attention_mask`, `stop_strings` with `tokenizer`, ...) or a strategy parameter; `draft_model=` names a
    drafter for the strategies that use one. With an explicit `custom_generate`, the call is transformers' own.

    >>> out = model.generate(input_ids, max_new_tokens=64)                    # native decoding  # doctest: +SKIP
    >>> out = model.generate(input_ids, decoding_strategy="s2d2", max_new_tokens=64,
    ...                      generator=torch.Generator().manual_seed(0))  # doctest: +SKIP
    """

    #: The `decoding_strategy` the family's own code decodes with (equal to its `FamilyPatch.native_strategy`).
    native_decoding_strategy: ClassVar[str] = "block_diffusion"

    def generate(self, *args, decoding_strategy: str | None = None, **kwargs):
        """The decoding backend with `decoding_strategy`, or with the model's default strategy.

        Raises:
            RuntimeError: if no decoding backend is installed (see :func:`decoding_backend`).
            ValueError: whatever the backend refuses (an unknown strategy, bad inputs), before any forward.
        """
        args, kwargs = positional_as_keywords(args, kwargs)      # a positional generation_config is read too
        if decoding_strategy is None and kwargs.get("custom_generate") is None:
            decoding_strategy = self.default_decoding_strategy(kwargs.get("generation_config"))
        if decoding_strategy is None:
            return super().generate(*args, **kwargs)
        return decoding_backend()(self, args, kwargs, decoding_strategy)

    def default_decoding_strategy(self, generation_config=None) -> str:
        """The strategy `generate()` runs when none is named: the one stored in the generation config (the
        call's, else the model's), else :attr:`native_decoding_strategy`."""
        return stored_decoding_strategy(generation_config, self.generation_config) or self.native_decoding_strategy


def stored_decoding(generation_config) -> dict[str, Any] | None:
    """What `generation_config` (a `GenerationConfig` or None) stores under :data:`GENERATION_CONFIG_KEY`: a dict
    naming its strategy under `decoding_strategy` beside the strategy's parameters, or None (nothing, or `{}`).

    Raises:
        ValueError: anything else stored there (not a dict, or no strategy name).
    """
    stored = getattr(generation_config, GENERATION_CONFIG_KEY, None) if generation_config is not None else None
    if stored is None or (isinstance(stored, dict) and not stored):
        return None
    name = stored.get("decoding_strategy") if isinstance(stored, dict) else None
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"`generation_config.{GENERATION_CONFIG_KEY}` (={stored!r}) must be a dict that names its "
                         "strategy under `decoding_strategy`, beside the strategy's parameters; store it with "
                         "`DecodingConfig.save_to_generation_config`, or delete the attribute.")
    return stored


def stored_decoding_strategy(*generation_configs) -> str | None:
    """The strategy stored under :data:`GENERATION_CONFIG_KEY` in the first of `generation_configs` (each a
    `GenerationConfig` or None; e.g. the call's, then the model's) that stores one, else None.

    Raises:
        ValueError: a malformed stored value (:func:`stored_decoding`).
    """
    for config in generation_configs:
        stored = stored_decoding(config)
        if stored is not None:
            return stored["decoding_strategy"]
    return None


__all__ = ["BACKEND_ENTRY_POINT_GROUP", "GENERATION_CONFIG_KEY", "DllmGenerationMixin", "decoding_backend",
           "register_decoding_backend", "stored_decoding", "stored_decoding_strategy"]
