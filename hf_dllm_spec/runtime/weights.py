"""A loaded model's weights: where its forward runs (accelerate placement) and how they are stored (bitsandbytes
quantization), with :func:`check_weights`, the one check that they can decode, run before any forward on the target,
a drafter and an `assistant_model` (every entry point).

Placement (docs/placement.md): the target and a drafter each keep their own device, dtype and `device_map`; token
ids go to a model's execution device (:func:`execution_device`) and its logits come back; caches never move. A
model with a weight on the meta device and no accelerate hook to bring it in is refused (:func:`unplaced_weight`).

Quantized weights (bitsandbytes 8-bit / 4-bit): pure helpers, nothing here imports bitsandbytes (a model's
quantization is read from its config and from its modules' class names), so the module loads without the `quant`
extra.

A target and a drafter are quantized independently, each by its own `from_pretrained(...,
quantization_config=BitsAndBytesConfig(...))`. bitsandbytes replaces exact `nn.Linear` modules only; every family
keeps its output head unquantized (transformers' defaults, and the family classes' `_keep_in_fp32_modules`).

Refused by :func:`check_quantized_model` before any forward (bitsandbytes 0.50.2, transformers 5.23; source:
`bitsandbytes/autograd/_functions.py::MatMul8bitLt.forward`, `bitsandbytes/nn/modules.py`,
`transformers/integrations/bitsandbytes.py::replace_with_bnb_linear`):

- 8-bit weights (LLM.int8, `load_in_8bit=True`) with activations that are not 16-bit (float32 from
  `dtype=torch.float32`, or a float32 checkpoint loaded without `dtype`): `MatMul8bitLt` casts the input of every
  8-bit matmul to float16 and logs a warning on each call, so float32 activations buy no precision, cost twice the
  activation memory and print a line per quantized layer per forward. 4-bit weights take any
  `bnb_4bit_compute_dtype`, float32 included (`Linear4bit` casts to it and back), and are not refused.
- A quantized layer whose weight is not a quantized parameter: an output head quantized while tied to the input
  embedding (possible on a transformers class when `llm_int8_skip_modules` replaces transformers' default skips),
  which fails at the first forward inside bitsandbytes (`AttributeError: 'Parameter' object has no attribute
  'CB'` for 8-bit, a bare `AssertionError` for 4-bit).
- Quantized weights on the meta device (a skeleton never loaded), which fail inside bitsandbytes; and quantized
  layers under an accelerate offload hook (weights on "meta", brought in per forward): on the CPU, 8-bit fails
  moving them to device 0 and 4-bit loses its quantization state after the first forward (bitsandbytes 0.50.2;
  not checked next to an accelerator). transformers' documented way keeps offloaded modules unquantized
  (`llm_int8_enable_fp32_cpu_offload=True`), which is not concerned.

Not refused: 8-bit with bfloat16 activations works (bitsandbytes casts to float16 and logs the same warning per
matmul; float16 is the dtype that runs without a cast), 4-bit with any compute dtype, quantized drafter with an
unquantized target or the reverse. CPU runs are for correctness only: bitsandbytes' CPU kernels are slower than
the unquantized path (8-bit greedy decoding of the bundled models took 1.5-2.4x the fp32 time on the project's
2-core machine); speed needs a GPU.
"""

from __future__ import annotations

from typing import Any

import torch

from ..validation import invalid

#: bitsandbytes module classes that hold quantized weights, by class name (no bitsandbytes import needed).
QUANTIZED_LINEAR_CLASSES = ("Linear8bitLt", "Linear4bit", "LinearNF4", "LinearFP4")
#: bitsandbytes parameter classes of quantized weights.
QUANTIZED_PARAM_CLASSES = ("Int8Params", "Params4bit")
#: Activation dtypes 8-bit weights run with (bitsandbytes casts every other dtype to float16 per matmul).
INT8_ACTIVATION_DTYPES = (torch.float16, torch.bfloat16)


def _get(config: Any, key: str, default: Any = None) -> Any:
    """A field of a quantization config given as a `QuantizationConfigMixin` or as a dict (a saved config)."""
    if isinstance(config, dict):
        return config.get(key, default)
    return getattr(config, key, default)


def _quantized_modules(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """`(name, module)` of every bitsandbytes layer of `model` (by class name and module path)."""
    return [(name, module) for name, module in model.named_modules()
            if type(module).__name__ in QUANTIZED_LINEAR_CLASSES
            and type(module).__module__.startswith("bitsandbytes")]


def quantization_of(model: torch.nn.Module) -> str | None:
    """Describe a loaded model's weight quantization.

    Read from `model.config.quantization_config` (set by `from_pretrained(quantization_config=...)`, an object or,
    from a saved config, a dict), else from the model's bitsandbytes layers (a model converted by hand with
    transformers' `replace_with_bnb_linear`).

    Args:
        model (`torch.nn.Module`): a loaded model (a transformers `PreTrainedModel` or any module).

    Returns:
        `str` or `None`: `"8bit"` (bitsandbytes LLM.int8), `"4bit-nf4"` / `"4bit-fp4"` (bitsandbytes 4-bit, with
        `"-dq"` appended for double quantization, e.g. `"4bit-fp4-dq"`), the `quant_method` name for another
        transformers quantization method (e.g. `"torchao"`, `"gptq"`), or `None` for unquantized weights.
    """
    config = getattr(getattr(model, "config", None), "quantization_config", None)
    if config is not None:
        method = _get(config, "quant_method")
        method = getattr(method, "value", method)          # QuantizationMethod is a str enum
        if method == "bitsandbytes":
            if _get(config, "load_in_8bit", _get(config, "_load_in_8bit", False)):
                return "8bit"
            if _get(config, "load_in_4bit", _get(config, "_load_in_4bit", False)):
                kind = f"4bit-{_get(config, 'bnb_4bit_quant_type', 'fp4')}"
                return kind + ("-dq" if _get(config, "bnb_4bit_use_double_quant", False) else "")
        if method is not None:
            return str(method)
    modules = _quantized_modules(model)
    if not modules:
        return None
    module = modules[0][1]
    if type(module).__name__ == "Linear8bitLt":
        return "8bit"
    weight = getattr(module, "weight", None)
    kind = f"4bit-{getattr(weight, 'quant_type', None) or getattr(module, 'quant_type', None) or 'fp4'}"
    return kind + ("-dq" if getattr(weight, "compress_statistics", False) else "")


def activation_dtype(model: torch.nn.Module) -> torch.dtype | None:
    """The dtype of the hidden states a quantized layer receives: the input embedding's weight dtype (what the
    decoder carries), else the model's `dtype`; `None` if neither is known."""
    try:
        embedding = model.get_input_embeddings()
    except (AttributeError, NotImplementedError):        # a bare module, or a model without an input embedding
        embedding = None
    weight = getattr(embedding, "weight", None)
    if isinstance(weight, torch.Tensor) and weight.is_floating_point():
        return weight.dtype
    dtype = getattr(model, "dtype", None)
    return dtype if isinstance(dtype, torch.dtype) else None


def check_quantized_model(model: torch.nn.Module, role: str = "model") -> None:
    """Raise `ValueError` if a (bitsandbytes-)quantized model cannot decode as loaded; unquantized models pass.

    Part of :func:`check_weights` (the target, a drafter, a transformers `assistant_model`, before any forward).
    The refused combinations and their sources are listed in the module docstring.

    Args:
        model (`torch.nn.Module`): the loaded model.
        role (`str`, defaults to `"model"`): the argument that passed it, named in the message (`"model"`,
            `"draft_model"`, `"assistant_model"`).

    Raises:
        ValueError: naming `role`: 8-bit weights with activations other than float16 / bfloat16; a quantized layer
            whose weight is not quantized (a head tied to the input embedding); quantized weights on the meta
            device.
    """
    kind = quantization_of(model)
    if kind is None:
        return
    name = type(model).__name__
    modules = _quantized_modules(model)
    on_meta = [n for n, m in modules if getattr(m, "weight", None) is not None and m.weight.device.type == "meta"]
    hooked = {n for n, m in modules if hasattr(m, "_hf_hook")}
    offloaded = [n for n in on_meta if n in hooked]
    if offloaded:
        raise invalid(role, f"<{name} with {kind} layers offloaded by accelerate ({offloaded[0]}, ...)>",
                      "keep its bitsandbytes layers on a device: accelerate's offload hooks cannot bring them in "
                      "per forward (8-bit fails moving them, 4-bit loses their quantization state after the first "
                      "forward)", "give the quantized modules a device in `device_map` (with "
                      "`llm_int8_enable_fp32_cpu_offload=True`, the modules you place on \"cpu\" stay unquantized), or "
                      "load without quantization")
    if on_meta:
        raise invalid(role, f"<{name} with {kind} weights on the meta device ({on_meta[0]}, ...)>",
                      "hold real quantized weights to decode", "load it with `from_pretrained(..., "
                      "quantization_config=BitsAndBytesConfig(...), device_map=...)` on a real device")
    unquantized = [n for n, m in modules
                   if getattr(m, "weight", None) is not None and type(m.weight).__name__ not in QUANTIZED_PARAM_CLASSES]
    if unquantized:
        raise invalid(role, f"<{name} whose bitsandbytes layer `{unquantized[0]}` holds an unquantized weight>",
                      "keep layers whose weight is shared (an output head tied to the input embedding) out of "
                      "quantization: bitsandbytes fails on them at the first forward",
                      "load without `llm_int8_skip_modules` (transformers then skips tied and output embeddings "
                      f"itself), or add '{unquantized[0].rsplit('.', 1)[-1]}' to it")
    if kind == "8bit":
        dtype = activation_dtype(model)
        if dtype is not None and dtype not in INT8_ACTIVATION_DTYPES:
            raise invalid(role, f"<{name} with 8-bit weights and {str(dtype).replace('torch.', '')} activations>",
                          "run 8-bit (LLM.int8) weights with 16-bit activations: bitsandbytes casts the input of "
                          "every 8-bit matmul to float16 (and logs a warning each time), so float32 activations "
                          "buy no precision",
                          "load with dtype=torch.float16 or torch.bfloat16 (float16 runs without the cast), or "
                          "load 4-bit weights (`load_in_4bit=True`), which take any `bnb_4bit_compute_dtype`; a "
                          "checkpoint saved 8-bit keeps its saved dtype whatever `dtype` says: quantize its "
                          "unquantized weights again")


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


def check_weights(model, name: str) -> torch.device:
    """Raise unless `model`'s weights can decode: real weights (refused on the meta device, never loaded; a model
    that accelerate dispatched with offload runs on its execution device and passes), and quantized weights that
    bitsandbytes can run (:func:`check_quantized_model`). Run before any forward on every model of a call.

    Args:
        model (`torch.nn.Module`): the loaded model.
        name (`str`): the argument that passed it, named in the message ("model", "draft_model",
            "assistant_model").

    Returns:
        `torch.device`: the model's execution device (:func:`execution_device`).

    Raises:
        ValueError: naming `name`: not a module, weights on the meta device without an offload hook, or a refused
            quantization (:func:`check_quantized_model`).
    """
    if not isinstance(model, torch.nn.Module):
        raise invalid(name, f"<{type(model).__name__}>", "be a loaded model (a transformers PreTrainedModel)",
                      f"load it first, e.g. `{name}=AutoModelForCausalLM.from_pretrained(path)`")
    device = execution_device(model)
    if device.type == "meta":
        raise invalid(name, f"<{type(model).__name__} on the meta device>", "hold real weights to decode",
                      "load it with `from_pretrained` (or `to_empty` and load a state dict) before calling generate")
    missing = unplaced_weight(model)
    if missing is not None:
        raise invalid(name, f"<{type(model).__name__} whose `{missing}` is on the meta device>",
                      "hold real weights to decode (only accelerate's offload hooks bring meta weights in per "
                      "forward)", "load the missing weights (or place the model with `from_pretrained(..., "
                      "device_map=...)`, which offloads with hooks) before calling generate")
    check_quantized_model(model, name)
    return device
