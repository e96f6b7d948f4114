"""The one bridge to transformers' private behaviour around `generate`: everything of it the library relies on that
transformers does not promise, in one module, each piece with the versions it was checked on
(`tests/test_front_door.py` runs every piece on the installed transformers; CI runs it on the newest and the oldest
supported release).

| piece | what it relies on | checked on |
|---|---|---|
| :func:`generate_call_arguments` | the frame of `GenerationMixin.generate` (its code object, locals `self`, `streamer`, `assistant_model`, `kwargs`) and of the decorators right above it (`args`, `kwargs`) | 5.17-5.24 |
| :func:`caller_stacklevel` | the source paths of transformers and torch frames | 5.17-5.24 |
| :func:`route_keywords` | `generate` routes a keyword to a `custom_generate` callable when its signature names it (else "model_kwargs are not used") | 5.17-5.24 |
| :func:`generate_with_callable` | `GenerationMixin.generate(model, ..., custom_generate=callable)` prepares the inputs, processors and criteria, then calls it | 5.17-5.24 |
| :func:`transformers_compiles` | `GenerationMixin._valid_auto_compile_criteria` (accelerator or `CompileConfig._compile_all_devices`, `HfQuantizer.is_compileable`, no cpu/disk offload, `disable_compile`) | 5.17-5.24 |
| :func:`spy_compile_decision` | the same method, called once per `generate` on the model | 5.17-5.24 |
| :func:`prepared_by_generate` | `Cache._is_user_defined`: False on the cache `generate` prepares itself | 5.17-5.24 |

Nothing else in the package reads transformers' frames or these private names. Three narrower private contacts stay
where they are used: `runtime.experts` sets the MoE experts kernel (`config._experts_implementation`),
`integration.candidate_generator` supplies DEER's candidate generator to assisted decoding, `integration.plan`
reads whether a streamer takes logits. The cache keyword's rename (`past_key_values` -> `cache` in 5.24) lives with
the model families in `model_patches.compat`.

Source: issue 33 ("One bridge").
"""

from __future__ import annotations

import inspect
import os
from typing import Any, Callable, Iterable

import torch
from transformers import GenerationConfig, GenerationMixin

from model_patches.generation import GENERATION_CONFIG_KEY

from .validation import invalid

#: The code object of transformers' `generate` (under its decorators): how its frame is recognised.
GENERATE_CODE = inspect.unwrap(GenerationMixin.generate).__code__


def generate_call_arguments(model) -> dict[str, Any]:
    """`streamer`, `assistant_model`, `tokenizer` and the raw `attention_mask` of the transformers `generate` call
    on `model` that invoked the caller, or `{}` when there is none (a direct call).

    transformers drops `streamer`, `assistant_model` and `tokenizer` for `custom_generate` callables, and derives
    `position_ids` from the mask as given before it drops an all-ones mask; they are read from its frame (the code
    object is checked, so another caller is never mistaken for it). `tokenizer` is popped inside `generate`: it is
    read from the decorators' frames right above it (`torch.no_grad`, transformers' `deprecate_kwarg`), which hold
    the call's keyword arguments as given.
    """
    frame = inspect.currentframe()
    try:
        caller = frame.f_back if frame is not None else None
        for _ in range(8):
            if caller is None:
                break
            if caller.f_code is GENERATE_CODE and caller.f_locals.get("self") is model:
                return _arguments_of(model, caller)
            caller = caller.f_back
    finally:
        del frame
    return {}


def _arguments_of(model, generate_frame) -> dict[str, Any]:
    found = {k: generate_frame.f_locals.get(k) for k in ("streamer", "assistant_model")}
    raw = generate_frame.f_locals.get("kwargs")
    found["attention_mask"] = raw.get("attention_mask") if isinstance(raw, dict) else None
    found["tokenizer"] = None
    wrapper = generate_frame.f_back
    while wrapper is not None and found["tokenizer"] is None:
        args, raw = wrapper.f_locals.get("args"), wrapper.f_locals.get("kwargs")
        if not (isinstance(args, tuple) and args and args[0] is model and isinstance(raw, dict)):
            break                                               # past the decorators of `generate`
        found["tokenizer"] = raw.get("tokenizer")
        wrapper = wrapper.f_back
    return found


def caller_stacklevel() -> int:
    """`stacklevel` that points a warning at the first frame outside the library, transformers and torch."""
    internal = tuple(f"{os.sep}{name}{os.sep}"
                     for name in ("hf_dllm_spec", "model_patches", "transformers", "torch", "custom_generate"))
    frame, level = inspect.currentframe(), 1
    try:
        while frame is not None and (level == 1 or any(part in frame.f_code.co_filename for part in internal)):
            frame, level = frame.f_back, level + 1
    finally:
        del frame
    return level - 1


#: Keywords of a `generate` call that are no generation option: the model inputs it prepares, the arguments it
#: pops (`tokenizer`, `assistant_tokenizer`, `trust_remote_code`, ...) and the stored strategy's key.
GENERATE_INPUTS = frozenset({"input_ids", "attention_mask", "position_ids", "inputs_embeds", "cache_position",
                             "past_key_values", "cache", "use_cache", "tokenizer", "assistant_tokenizer",
                             "trust_remote_code", "use_model_defaults", "kwargs", GENERATION_CONFIG_KEY})


def generate_keywords() -> frozenset[str]:
    """The keywords transformers' `generate` takes for itself: its parameters, every public `GenerationConfig`
    option and :data:`GENERATE_INPUTS`. A `custom_generate` callable that names one in its signature receives it
    instead of transformers' generation config."""
    options = {name for name in vars(GenerationConfig()) if not name.startswith("_")}
    return frozenset(options | set(inspect.signature(GenerationMixin.generate).parameters) | GENERATE_INPUTS)


#: The arguments of the library's `custom_generate` callable (`hf_dllm_spec.dllm_generate`) besides the strategy
#: parameters (a test holds them against its signature): a strategy parameter of one of these names would be taken
#: by the callable itself.
CALLABLE_ARGUMENTS = frozenset({
    "model", "input_ids", "logits_processor", "stopping_criteria", "generation_config", "synced_gpus", "streamer",
    "decoding_strategy", "generator", "mask_token_id", "strategy_config", "preset", "draft_model", "assistant_model",
    "draft_mask_token_id", "stop_strings", "row_feed"})


def check_routable(names: Iterable[str], reserved: Iterable[str] = CALLABLE_ARGUMENTS,
                   callable_name: str = "dllm_generate") -> None:
    """Refuse strategy parameter `names` that transformers' `generate` would route away from its own use, for every
    strategy: one of :func:`generate_keywords`, or of `reserved` (the arguments of the `custom_generate` callable
    `callable_name`, by default the library's, :data:`CALLABLE_ARGUMENTS`).

    Raises:
        ValueError: naming the first such parameter and how to rename it.
    """
    taken = generate_keywords() | set(reserved)
    clash = next((name for name in names if name in taken), None)
    if clash is not None:
        raise invalid("strategy parameter", clash, "not be named like an argument of transformers' `generate`, a "
                      f"`GenerationConfig` option or an argument of `{callable_name}` (transformers would hand "
                      "that keyword to the strategies instead of using it, for every strategy)",
                      f"rename the config field, e.g. `my_{clash}`")


def route_keywords(function: Callable, base: inspect.Signature, names: Iterable[str], default: Any) -> None:
    """Give `function` the signature `base` plus keyword-only parameters `names` (default `default`), so that
    transformers' `generate` routes those keywords to it as a `custom_generate` callable and still rejects typos.

    Raises:
        ValueError: a name of `names` that is a parameter of `base` or one of :func:`generate_keywords`
            (:func:`check_routable`); nothing changes.
    """
    params = [p for p in base.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
    names = list(names)
    check_routable(names, {p.name for p in params}, function.__name__)
    params += [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default) for name in names]
    params.append(inspect.Parameter("kwargs", inspect.Parameter.VAR_KEYWORD))
    function.__signature__ = base.replace(parameters=params)


def generate_with_callable(model, *args, custom_generate: Callable, **kwargs):
    """transformers' own `generate` of `model` with `custom_generate`: it prepares the generation config, logits
    processors and stopping criteria, then calls the callable (so a direct call of the callable gets the same
    preparation as every other entry point)."""
    return GenerationMixin.generate(model, *args, custom_generate=custom_generate, **kwargs)


def transformers_compiles(model, generation_config: GenerationConfig, device: torch.device, *,
                          ignore_quantizer: bool = False) -> tuple[bool, str]:
    """transformers' rule for compiling a `generate` decode step over a static cache
    (`GenerationMixin._valid_auto_compile_criteria`), for `model` running on `device` (its quantizer's word left
    out with `ignore_quantizer`).

    Returns:
        `(compiles, reason)`: `reason` says why not ("" when it compiles). CUDA is the accelerator the library
        captures on; other accelerators are not distinguished here.
    """
    config = generation_config.compile_config
    if generation_config.disable_compile:
        return False, "disable_compile=True"
    all_devices = bool(config is not None and getattr(config, "_compile_all_devices", False))
    if device.type != "cuda" and not all_devices:
        return False, f"no compilation on {device.type} (transformers compiles on accelerators, or with " \
                      "`CompileConfig._compile_all_devices`)"
    quantizer = None if ignore_quantizer else getattr(model, "hf_quantizer", None)
    if quantizer is not None and not quantizer.is_compileable:
        return False, f"{type(quantizer).__name__} weights cannot be compiled or captured (transformers' " \
                      "`HfQuantizer.is_compileable` is False)"
    devices = {str(d) for d in getattr(model, "hf_device_map", {}).values()}
    if "cpu" in devices and len(devices) > 1 or "disk" in devices:
        return False, "offloaded weights (`device_map` with cpu/disk) cannot be compiled"
    return True, ""


def spy_compile_decision(model) -> tuple[Callable[[], bool | None], Callable[[], None]]:
    """Spy on `model._valid_auto_compile_criteria`, transformers' own compile decision in `generate`.

    Returns:
        `(decision, restore)`: `decision()` is the value the rule returned in the last `generate` call (None if
        it was not called: a transformers without the rule), `restore()` removes the spy.
    """
    seen: list[bool] = []
    original = getattr(model, "_valid_auto_compile_criteria", None)
    if original is None:
        return (lambda: None), (lambda: None)

    def spy(*args, **kwargs):
        value = bool(original(*args, **kwargs))
        seen.append(value)
        return value

    model._valid_auto_compile_criteria = spy

    def restore() -> None:
        model.__dict__.pop("_valid_auto_compile_criteria", None)

    return (lambda: seen[-1] if seen else None), restore


def prepared_by_generate(cache) -> bool:
    """Whether `cache` is one transformers' `generate` prepared itself (not passed by the caller)."""
    return not getattr(cache, "_is_user_defined", False)


__all__ = ["GENERATE_CODE", "caller_stacklevel", "generate_call_arguments", "generate_with_callable",
           "prepared_by_generate", "route_keywords", "spy_compile_decision", "transformers_compiles"]
