"""The loading options `hf-dllm-spec generate` and `hf-dllm-spec serve` share, and the one loader behind both.

    --dtype {auto,float32,bfloat16,float16}   the weights' dtype (`from_pretrained(dtype=...)`; auto: the checkpoint's)
    --device DEVICE                           where the model is moved (default cpu)
    --device-map MAP                          accelerate's placement instead: auto, balanced, sequential, a device,
                                              or a JSON object {"module": device} (`from_pretrained(device_map=...)`)
    --quantization {4bit,8bit}                bitsandbytes weights of the target (`BitsAndBytesConfig`)
    --draft-device DEVICE                     the drafter's device (default: the target's execution device)

What each becomes is transformers' own: `AutoModelForCausalLM.from_pretrained(path, dtype=..., device_map=...,
quantization_config=BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_compute_dtype=dtype) or (load_in_8bit=True))`.
A quantized target without `--device-map` is loaded with `device_map={"": device}` (bitsandbytes quantizes the
weights where they are loaded; a quantized model cannot be moved afterwards). The drafter is loaded unquantized
in the same dtype (a drafter is small; :mod:`hf_dllm_spec.runtime.weights` allows either to be quantized).

Refused before anything loads, as usage errors naming the flag: `--device` with `--device-map`, `--quantization`
without bitsandbytes or with `--dtype float32` for 8-bit (LLM.int8 runs 16-bit activations), a `--device-map`
without accelerate or that is neither a name nor a JSON object. After loading, the library's own check of quantized
weights (:func:`hf_dllm_spec.runtime.weights.check_quantized_model`) runs on the target, its message naming
the flag.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
from dataclasses import dataclass
from typing import Any

from ..cli_args import DTYPES, UsageError, torch_device

LOAD_DTYPES = ("auto", *DTYPES)
QUANTIZATIONS = ("4bit", "8bit")
DEVICE_MAP_NAMES = ("auto", "balanced", "balanced_low_0", "sequential")


def add_loading_arguments(parser: argparse.ArgumentParser) -> None:
    """The loading options (module docstring) on `parser`, in their own group."""
    group = parser.add_argument_group("loading")
    group.add_argument("--dtype", default="float32", choices=LOAD_DTYPES,
                       help="dtype the weights load in; auto: the checkpoint's own (default float32)")
    group.add_argument("--device", default=None, help="e.g. cpu, cuda, cuda:1 (default cpu; not with --device-map)")
    group.add_argument("--device-map", default=None, metavar="MAP",
                       help="accelerate's placement, from_pretrained(device_map=MAP): auto, balanced, sequential, a "
                            "device, or a JSON object such as '{\"\": 0}' (default: none, the whole model on --device)")
    group.add_argument("--quantization", default=None, choices=QUANTIZATIONS,
                       help="bitsandbytes weights of the target model (BitsAndBytesConfig; extra `quant`); 8bit "
                            "needs --dtype float16 or bfloat16 (default: none)")
    group.add_argument("--draft-device", default=None, metavar="DEVICE",
                       help="device of --draft-model (default: the target's execution device)")


@dataclass(frozen=True)
class LoadOptions:
    """How `generate` and `serve` load their models (the loading options; None: the default).

    Attributes:
        dtype (`str`): "auto" or a torch dtype name. device (`str`, *optional*): where to move the model (default
        "cpu"). device_map (`str` or `dict`, *optional*): accelerate's placement. quantization (`str`, *optional*):
        "4bit" or "8bit". draft_device (`str`, *optional*): the drafter's device.
    """

    dtype: str = "float32"
    device: str | None = None
    device_map: str | dict | None = None
    quantization: str | None = None
    draft_device: str | None = None

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "LoadOptions":
        """The options of parsed command-line arguments (:func:`add_loading_arguments`), checked.

        Raises:
            UsageError: see :meth:`check`.
        """
        options = cls(args.dtype, args.device, _device_map(args.device_map), args.quantization, args.draft_device)
        options.check()
        if options.draft_device is not None and getattr(args, "draft_model", None) is None:
            raise UsageError("--draft-device", f"places the drafter (={options.draft_device!r}), and no "
                                               "--draft-model is given: pass --draft-model PATH or drop --draft-device")
        return options

    def check(self) -> None:
        """Refuse the combinations that cannot load (module docstring), before anything loads.

        Raises:
            UsageError: naming the flag.
        """
        if self.dtype not in LOAD_DTYPES:
            raise UsageError("--dtype", f"must be one of {', '.join(LOAD_DTYPES)}, got {self.dtype!r}")
        if self.device is not None and self.device_map is not None:
            raise UsageError("--device-map", "places the model itself: drop --device (or drop --device-map)")
        if self.device_map is not None and importlib.util.find_spec("accelerate") is None:
            raise UsageError("--device-map", "needs accelerate: pip install accelerate")
        for flag, device in (("--device", self.device), ("--draft-device", self.draft_device)):
            if device is not None:
                torch_device(flag, device)
        places = (self.device_map.values() if isinstance(self.device_map, dict)
                  else [self.device_map] if self.device_map not in (None, *_STRATEGIES_OF_PLACEMENT) else [])
        for device in places:
            if device != "disk":
                torch_device("--device-map", device)
        if self.quantization is None:
            return
        if "disk" in places:
            raise UsageError("--device-map", "places modules on disk, and bitsandbytes layers cannot be offloaded "
                                             "(they fail inside bitsandbytes or accelerate at a forward): place every "
                                             "module on a device, or drop --quantization")
        if self.quantization not in QUANTIZATIONS:
            raise UsageError("--quantization", f"must be one of {', '.join(QUANTIZATIONS)}, got "
                                               f"{self.quantization!r}")
        if importlib.util.find_spec("bitsandbytes") is None:
            raise UsageError("--quantization", "needs bitsandbytes: pip install -e '<checkout>[quant]' (or pip "
                                               "install bitsandbytes)")
        if self.quantization == "8bit" and self.dtype == "float32":
            raise UsageError("--quantization", "8bit (LLM.int8) runs 16-bit activations (bitsandbytes casts every "
                                               "8-bit matmul's input to float16): pass --dtype float16 or bfloat16, "
                                               "or --quantization 4bit, which takes float32")

    def torch_dtype(self):
        """"auto" or the `torch.dtype` of :attr:`dtype`."""
        import torch

        return "auto" if self.dtype == "auto" else getattr(torch, self.dtype)

    def quantization_config(self):
        """transformers' `BitsAndBytesConfig` of :attr:`quantization` (4-bit computes in the load dtype, float32
        for "auto"), or None."""
        if self.quantization is None:
            return None
        import torch
        from transformers import BitsAndBytesConfig

        if self.quantization == "8bit":
            return BitsAndBytesConfig(load_in_8bit=True)
        compute = torch.float32 if self.dtype == "auto" else self.torch_dtype()
        return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_compute_dtype=compute)

    def from_pretrained_kwargs(self, quantized: bool = True) -> dict[str, Any]:
        """The keywords of `AutoModelForCausalLM.from_pretrained` (`quantized=False`: the drafter's, unquantized
        and without the device map)."""
        kwargs: dict[str, Any] = {"dtype": self.torch_dtype()}
        if quantized and self.device_map is not None:
            kwargs["device_map"] = self.device_map
        if quantized and self.quantization is not None:
            kwargs["quantization_config"] = self.quantization_config()
            kwargs.setdefault("device_map", {"": self.device or "cpu"})
        return kwargs


#: accelerate's placement strategies (`device_map="auto"`, ...); any other string is a device.
_STRATEGIES_OF_PLACEMENT = ("auto", "balanced", "balanced_low_0", "sequential")


def _device_map(text: str | None) -> str | dict | None:
    """`--device-map` text: a JSON object, else a name or a device (kept as the string)."""
    if text is None or not text.strip().startswith("{"):
        return text
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise UsageError("--device-map", f"is not a JSON object ({err}); pass e.g. '{{\"\": 0}}' or auto") from None
    return value


def load_model(path: str, options: LoadOptions, *, flag: str = "--model", quantized: bool = True,
               device: str | None = None):
    """`(tokenizer, model)` of `path` with `options` (through the Auto classes, no remote code; the library's
    classes registered first); the model moved to `device` (default `options.device`, "cpu") unless it was placed
    by a device map.

    Raises:
        UsageError: the checkpoint cannot be loaded (naming `flag`), or the library refuses the quantized model
            (:func:`~hf_dllm_spec.runtime.weights.check_quantized_model`).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .. import register_auto_classes
    from ..runtime.weights import check_quantized_model

    register_auto_classes()
    kwargs = options.from_pretrained_kwargs(quantized)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, **kwargs).eval()
    except OSError as err:
        raise UsageError(flag, f"cannot load {path!r}: {str(err).strip().splitlines()[0]}") from err
    if "device_map" not in kwargs:
        model.to(device or options.device or "cpu")
    try:
        check_quantized_model(model, "draft_model" if flag == "--draft-model" else "model")
    except ValueError as err:         # the checkpoint's own quantization (a drafter is loaded unquantized)
        raise UsageError("--quantization" if options.quantization and quantized else flag, str(err)) from err
    return tokenizer, model


def load_models(model: str, draft_model: str | None, options: LoadOptions):
    """`(tokenizer, target, drafter or None)`: the target with every option, the drafter unquantized on
    `options.draft_device` (default: the target's execution device).

    Raises:
        UsageError: see :func:`load_model`.
    """
    from ..runtime.weights import execution_device

    tokenizer, target = load_model(model, options)
    drafter = None
    if draft_model is not None:
        device = options.draft_device or str(execution_device(target))
        drafter = load_model(draft_model, options, flag="--draft-model", quantized=False, device=device)[1]
    return tokenizer, target, drafter
