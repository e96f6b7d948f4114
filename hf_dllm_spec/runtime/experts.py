"""Routed experts a CUDA graph can capture, in every dtype a MoE family loads in.

transformers runs routed experts through `@use_experts_implementation` and picks the kernel from
`config._experts_implementation`; the library's LLaDA2 classes get "grouped_mm" (one fixed-shape grouped matmul
per projection). That kernel is not always capturable (transformers 5.17-5.24 `integrations/moe.py`,
`_can_use_grouped_mm`):

- under `torch.compile` with weights other than bfloat16, transformers sends it to `_grouped_mm_fallback`, a loop
  over `offs.tolist()` (a host synchronisation inside an opaque custom op, which a CUDA graph cannot capture);
- on CUDA, PyTorch's grouped matmul is made for bfloat16 on SM80+; other dtypes, older cards and torch builds
  without it fall back too, below Python, where `count_host_syncs` cannot see it.

Where that happens, the static runtime runs transformers' own "batched_mm" experts instead (gather each routed
token's expert weights, then `torch.bmm`: fixed shapes, no synchronisation, equal to "grouped_mm" to float
tolerance: `tests/test_static_runtime.py`), only while its forwards run (:func:`experts_implementation`): the
model's own setting is left as it is for every other use.

Source: issue 32; transformers `integrations/moe.py` (`_can_use_grouped_mm`, `batched_mm_experts_forward`).
"""

from __future__ import annotations

import contextlib

import torch

#: The sync-free replacement: transformers' gather + batched-matmul experts.
CAPTURABLE_EXPERTS = "batched_mm"


def experts_configs(model) -> list:
    """The distinct configs that the model's `@use_experts_implementation` modules read their kernel from."""
    configs = {}
    for module in model.modules():
        if hasattr(module, "is_concatenated") and hasattr(module, "has_gate") and hasattr(module, "config"):
            configs[id(module.config)] = module.config
    return list(configs.values())


def grouped_mm_capturable(dtype: torch.dtype, device: torch.device, compiled: bool) -> tuple[bool, str]:
    """Whether transformers' "grouped_mm" experts run one capturable kernel for weights of `dtype` on `device`.

    Args:
        dtype (`torch.dtype`): the experts' weight dtype.
        device (`torch.device`): where they run.
        compiled (`bool`): under `torch.compile` (transformers then falls back for anything but bfloat16).

    Returns:
        `(capturable, reason)`: `reason` says why not ("" when capturable).
    """
    if dtype != torch.bfloat16 and (compiled or device.type == "cuda"):
        return False, f"grouped_mm falls back to a host-synchronising path for {str(dtype).removeprefix('torch.')}"
    if device.type == "cuda":
        if not (hasattr(torch.nn.functional, "grouped_mm") or hasattr(torch, "_grouped_mm")):
            return False, "this torch build has no grouped_mm"
        if torch.cuda.get_device_capability(device) < (8, 0):
            return False, "grouped_mm needs a compute capability of 8.0 or more"
    return True, ""


def capturable_experts(model, compile_mode: str, device: torch.device) -> tuple[str | None, str]:
    """The experts implementation the static runtime runs `model` with, and why.

    Args:
        model (`PreTrainedModel`): any model; only MoE models with "grouped_mm" experts are concerned.
        compile_mode (`str`): the static runtime's mode ("eager", "cuda_graph", "compile").
        device (`torch.device`): the model's execution device.

    Returns:
        `(implementation, reason)`: :data:`CAPTURABLE_EXPERTS` with the reason where "grouped_mm" would not be
        captured, else `(None, "")` (the model's own setting is kept).
    """
    if compile_mode == "eager":
        return None, ""
    configs = experts_configs(model)
    if not configs or any(config._experts_implementation != "grouped_mm" for config in configs):
        return None, ""
    experts = next(module for module in model.modules() if hasattr(module, "is_concatenated"))
    weight = next((p for p in experts.parameters() if p.dim() == 3), None)
    dtype = weight.dtype if weight is not None else model.dtype
    capturable, reason = grouped_mm_capturable(dtype, device, compiled=compile_mode == "compile")
    return (None, "") if capturable else (CAPTURABLE_EXPERTS, reason)


@contextlib.contextmanager
def experts_implementation(configs: list, implementation: str | None):
    """Run the routed experts that read `configs` (:func:`experts_configs` of a model) with `implementation` inside
    the block (nothing when None), then restore their setting."""
    if implementation is None:
        yield
        return
    before = [config._experts_implementation for config in configs]
    for config in configs:
        config._experts_implementation = implementation
    try:
        yield
    finally:
        for config, value in zip(configs, before):
            config._experts_implementation = value


__all__ = ["CAPTURABLE_EXPERTS", "capturable_experts", "experts_configs", "experts_implementation", "grouped_mm_capturable"]
