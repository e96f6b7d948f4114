"""Where a model runs: accelerate-dispatched models (`device_map`, CPU / disk offload) and plain ones alike.

See docs/placement.md: the target and a drafter each keep their own device, dtype and `device_map`; token ids go
to a model's execution device and its logits come back; caches never move.
"""

from __future__ import annotations

import torch


def execution_device(model) -> torch.device:
    """The device a model's forward runs on: where its inputs go and its logits come back.

    `model.device` is the device of the first parameter. With accelerate big-model dispatch (`from_pretrained(...,
    device_map=..., offload_folder=...)` with "cpu" or "disk" entries, or `accelerate.cpu_offload`), an offloaded
    first parameter (the embeddings, often) lives on the meta device and `model.device` is "meta", while the
    forward runs on the hook's execution device: accelerate's `AlignDevicesHook.execution_device` on the root
    module (the `main_device` of `accelerate.dispatch_model`: the first device of `hf_device_map` that is neither
    "cpu" nor "disk", else "cpu"; the root hook also brings outputs back to the inputs' device). The same lookup
    as diffusers' `DiffusionPipeline._execution_device`: the root hook first, then the first hooked submodule.

    Args:
        model (`torch.nn.Module`): a (possibly dispatched) model.

    Returns:
        `torch.device`: the hook's execution device where accelerate dispatched the model, else `model.device`
        (the first parameter's device; "meta" for a model without weights, which the checks refuse).
    """
    if getattr(model, "_hf_hook", None) is None and not getattr(model, "hf_device_map", None):
        return model.device                                     # not dispatched: no module walk per call
    for module in model.modules():                              # the root module first
        hook = getattr(module, "_hf_hook", None)
        for h in getattr(hook, "hooks", (hook,)):              # a `SequentialHook` chains several
            device = getattr(h, "execution_device", None)
            if device is not None:
                return torch.device(device)                     # an int is an accelerator index
    return model.device


def unplaced_weight(model) -> str | None:
    """The name of a parameter or buffer of `model` that is on no device: on "meta" with no accelerate hook
    (`_hf_hook` on its module or an enclosing one) to bring it in per forward, as a part moved to "meta" by hand
    (it fails inside torch at the first forward). None when every weight is placed (offloaded ones included).

    Args:
        model (`torch.nn.Module`): a (possibly dispatched) model.

    Returns:
        `str` or None: the first such tensor's qualified name.
    """
    tensors = [*model.named_parameters(), *model.named_buffers()]
    if not any(t.device.type == "meta" for _, t in tensors):
        return None
    hooked = {n for n, m in model.named_modules() if getattr(m, "_hf_hook", None) is not None}
    for tensor_name, tensor in tensors:
        parts = tensor_name.split(".")[:-1]
        if tensor.device.type == "meta" and not any(".".join(parts[:i]) in hooked for i in range(len(parts) + 1)):
            return tensor_name
    return None
