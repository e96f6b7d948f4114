"""The differences between the supported transformers versions (5.17 to the newest 5.x), in one place.

Every other module of `model_patches` and `hf_dllm_spec` goes through these names and never tests a version.

| what | transformers 5.17 - 5.23 | transformers 5.24 and later |
|---|---|---|
| the cache keyword of model forwards and `prepare_inputs_for_generation` | `past_key_values` | `cache` (`past_key_values` still accepted, with a `FutureWarning`, until 5.40) |
| where `generate()` puts the cache it prepares (`model_kwargs`, a `custom_generate` callable's kwargs) | `past_key_values` | `cache` |
| the cache field of model outputs | `.past_key_values` | `.cache` (`.past_key_values` an alias) |
| `StaticCache` layers (`StaticLayer.crop(-k)`) | cannot crop | crop |

What runs is read from the installed transformers itself (the parameters of
`GenerationMixin.prepare_inputs_for_generation`, the fields of `CausalLMOutputWithPast`, the `is_croppable` flag of a
cache), never from its version string, so a development build of transformers is served by what it does.
Source: transformers 5.24 release (the `past_key_values` -> `cache` rename); `shared/reference/platform.md`.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable

import transformers
from transformers import GenerationMixin
from transformers.cache_utils import Cache
from transformers.modeling_outputs import CausalLMOutputWithPast

#: Every name a cache may arrive under, newest first (a forward or a `model_kwargs` dict of any supported version).
CACHE_NAMES: tuple[str, ...] = ("cache", "past_key_values")

#: The cache keyword of this transformers: what its `generate()` puts in `model_kwargs`, what
#: `prepare_inputs_for_generation` emits and its model forwards take without a deprecation warning.
CACHE_KWARG: str = ("cache" if "cache" in inspect.signature(GenerationMixin.prepare_inputs_for_generation).parameters
                    else "past_key_values")

#: The cache field of this transformers' model outputs (`CausalLMOutputWithPast` and its kin).
OUTPUT_CACHE_FIELD: str = ("cache" if "cache" in getattr(CausalLMOutputWithPast, "__dataclass_fields__", {})
                           else "past_key_values")

TRANSFORMERS_VERSION: str = transformers.__version__


def cache_kwarg(cache: Cache | None) -> dict[str, Cache | None]:
    """`{CACHE_KWARG: cache}`: the keyword argument that hands `cache` to a model forward (or to a transformers
    helper such as `create_bidirectional_mask`) of the installed transformers without a deprecation warning."""
    return {CACHE_KWARG: cache}


def cache_field(cache: Cache | None) -> dict[str, Cache | None]:
    """`{OUTPUT_CACHE_FIELD: cache}`: the keyword argument that sets the cache of a model output dataclass
    (`CausalLMOutputWithPast(logits=..., **cache_field(cache))`)."""
    return {OUTPUT_CACHE_FIELD: cache}


def find_cache(mapping: dict[str, Any]) -> Cache | None:
    """The cache in `mapping` (a `model_kwargs` dict, a forward's kwargs) under any of :data:`CACHE_NAMES`, or `None`.

    Raises:
        ValueError: if two names hold two different caches (`cache=` and `past_key_values=` together).
    """
    found = [(name, mapping[name]) for name in CACHE_NAMES if mapping.get(name) is not None]
    if len(found) > 1 and found[0][1] is not found[1][1]:
        raise ValueError(f"`cache` and `past_key_values` (={type(found[1][1]).__name__}) are both given: they name the "
                         f"same argument (transformers {TRANSFORMERS_VERSION} calls it `{CACHE_KWARG}`); pass only "
                         f"`{CACHE_KWARG}`.")
    return found[0][1] if found else None


def cache_used(cache: Cache) -> bool:
    """Whether `cache` has stored anything: tokens, or a layer that an earlier decoding initialised (a dynamic
    layer whose rows a decoding dropped holds no tokens, `get_seq_length() == 0`, yet its tensors have no rows left
    and the next `update` fails inside transformers). Read from every supported version's `is_initialized` flag of
    cache layers."""
    return cache.get_seq_length() != 0 or any(getattr(layer, "is_initialized", False)
                                               for layer in getattr(cache, "layers", ()))


def pop_cache(mapping: dict[str, Any]) -> Cache | None:
    """:func:`find_cache`, then remove every cache name from `mapping`.

    Raises:
        ValueError: as :func:`find_cache`.
    """
    cache = find_cache(mapping)
    for name in CACHE_NAMES:
        mapping.pop(name, None)
    return cache


def output_cache(output: Any) -> Cache | None:
    """The cache a model output carries (`.cache` on transformers >= 5.24, `.past_key_values` before), or `None`."""
    return getattr(output, OUTPUT_CACHE_FIELD, None)


def accepts_cache_names(forward: Callable) -> Callable:
    """Decorate a forward whose parameter is `cache` so that it also takes the cache as `past_key_values`.

    transformers <= 5.23 hands the cache to a forward as `past_key_values`, 5.24 and later as `cache`; a model
    class of this package declares `cache` and takes both, so stock `generate()` keeps its KV cache on every
    supported version (a forward that declared only the old name would silently run without it on 5.24).

    Raises:
        ValueError: (at call time) if both names are given with different caches.
    """

    @functools.wraps(forward)
    def wrapper(*args, **kwargs):
        if "past_key_values" in kwargs:
            kwargs["cache"] = pop_cache(kwargs)
        return forward(*args, **kwargs)

    return wrapper


def crop(cache: Cache, num_tokens: int) -> None:
    """Drop the last `num_tokens` (>= 1) tokens of every layer of `cache` (`cache.crop(-num_tokens)`).

    Raises:
        NotImplementedError: for a cache whose layers cannot crop on this transformers (a `StaticCache` before 5.24),
            naming the cache and the fix.
    """
    layers = getattr(cache, "layers", ())
    if not all(getattr(layer, "is_croppable", True) for layer in layers):
        raise NotImplementedError(
            f"{type(cache).__name__} cannot drop its last {num_tokens} tokens on transformers {TRANSFORMERS_VERSION} "
            "(its layers are not croppable); use a DynamicCache, or transformers >= 5.24 for a StaticCache.")
    cache.crop(-num_tokens)


__all__ = ["CACHE_KWARG", "CACHE_NAMES", "OUTPUT_CACHE_FIELD", "TRANSFORMERS_VERSION", "accepts_cache_names",
           "cache_field", "cache_kwarg", "crop", "find_cache", "output_cache", "pop_cache"]
