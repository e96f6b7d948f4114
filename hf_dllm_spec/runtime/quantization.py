"""Quantized weights (bitsandbytes 8-bit / 4-bit): what a loaded model holds, and the combinations refused.

Pure helpers: nothing here imports bitsandbytes (a model's quantization is read from its config and from its
modules' class names), so the module loads without the `quant` extra.

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

    Called before any forward for the target (`role="model"`) and the drafter (`role="draft_model"`) where
    decoding starts (`hf_dllm_spec.integration.generate`, every entry point), and for a transformers `assistant_model` by
    :func:`hf_dllm_spec.integration.checks.check_call`. The refused combinations and their sources are listed in the module
    docstring.

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
