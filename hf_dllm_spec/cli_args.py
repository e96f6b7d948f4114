"""The command-line argument helpers the tools and the server share: argparse types, the choices of `--dtype` and
`--cache-implementation`, and the usage error every command prints the same way.

Below both `hf_dllm_spec.tools` (the jobs, the cost model, the benchmarks) and `hf_dllm_spec.serving` (the server):
the server never imports the tools.
"""

from __future__ import annotations

import argparse
import difflib
import math
import re
from typing import Iterable


#: `--dtype` choices: the model's parameter and activation dtype (bfloat16 is the fast CPU path).
DTYPES = ("float32", "bfloat16", "float16")
#: `--cache-implementation` choices (transformers' names): "dynamic", the eager runtime over a growing cache (the
#: default), or "static", the static runtime (`hf_dllm_spec.runtime.static`: a preallocated cache, CUDA graphs).
CACHE_IMPLEMENTATIONS = ("dynamic", "static")


def add_dtype_argument(parser: argparse.ArgumentParser) -> None:
    """`--dtype {float32,bfloat16,float16}`, the dtype models load in (default float32); logits the acceptance
    tests read are float32 whatever it is."""
    parser.add_argument("--dtype", default="float32", choices=DTYPES,
                        help="dtype the models load in (default float32; bfloat16 is faster on CPU)")


class UsageError(ValueError):
    """A bad command-line argument: the command prints "hf-dllm-spec CMD: error: argument FLAG: MESSAGE" and
    exits with status 2, without a traceback (`--debug` shows it).

    Args:
        flag (`str`): the option or positional as the user typed it (`--block-sizes`, `OUTPUT_DIR`).
        message (`str`): what is wrong and how to fix it.
    """

    def __init__(self, flag: str, message: str):
        super().__init__(f"argument {flag}: {message}")
        self.flag = flag


def torch_device(flag: str, value: str | int, no_cuda_fix: str = "pass cpu, or run on a machine with a GPU and a CUDA "
                 "build of torch"):
    """The `torch.device` a command-line value names, checked before anything loads: torch must parse it, and a
    CUDA device must exist here (a visible index).

    Args:
        flag (`str`): the option as typed (`--device`, `--draft-device`, `--count-device`).
        value (`str` or `int`): its value (`cpu`, `cuda`, `cuda:1`, ...; an int is a CUDA index, as in a
            `device_map`).
        no_cuda_fix (`str`): what to do instead when the value names CUDA on a machine without it.

    Returns:
        `torch.device`: the parsed device.

    Raises:
        UsageError: naming `flag`, for a value torch cannot parse, a CUDA device where torch sees none, or a CUDA
            index beyond `torch.cuda.device_count()`.
    """
    import torch

    try:
        device = torch.device(value)
    except (RuntimeError, TypeError):
        raise UsageError(flag, f"must be a torch device (cpu, cuda, cuda:1, mps, ...), got {value!r}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UsageError(flag, f"names a CUDA device ({value!r}) but torch here sees none "
                               f"(torch.cuda.is_available() is False): {no_cuda_fix}")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise UsageError(flag, f"names {value!r} but torch sees {torch.cuda.device_count()} CUDA device(s): pass "
                               f"cuda:0 ... cuda:{torch.cuda.device_count() - 1}")
    return device


def did_you_mean(value: str, choices: Iterable[str]) -> str:
    """" (did you mean 'x'?)" for the closest of `choices` to `value` (difflib), else ""."""
    close = difflib.get_close_matches(str(value), list(choices), n=1, cutoff=0.5)
    return f" (did you mean {close[0]!r}?)" if close else ""


def suggest(message: str) -> str:
    """A library message with " (did you mean 'x'?)" appended, when it names a choice or a
    parameter ("`preset` (='sdar-4b-confg-a') must be one of 'a', 'b'...", "`typo` (=1) must be a parameter of
    ...; remove it, or use one of: a, b"); otherwise `message` unchanged."""
    m = re.match(r"`(\w+)` \(=(.*?)\) must (be one of (.*?); |be a parameter of .*use one of: (.*)\.$)", message)
    if not m:
        return message
    if m.group(4) is not None:        # a choice: the value among the listed choices
        value = m.group(2).strip("'\"")
        choices = re.findall(r"'([^']*)'", m.group(4))
    else:                             # an unknown parameter name
        value, choices = m.group(1), [c.strip() for c in m.group(5).split(",")]
    hint = did_you_mean(value, choices)
    return message + hint


def non_negative_int(text: str) -> int:
    """argparse type: an integer >= 0 (a prompt count)."""
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1 (a block size, a batch size, a count of repeats)."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def prompt_text(text: str) -> str:
    """argparse type: a non-empty prompt of valid UTF-8 text (a byte the terminal's encoding cannot decode reaches
    Python as a lone surrogate, which the tokenizer refused with a TypeError)."""
    if not text:
        raise argparse.ArgumentTypeError("must be non-empty text: pass the question to decode from")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        code = ord(err.object[err.start])              # an undecodable byte b arrives as the surrogate U+DC00 + b
        shown = f"byte 0x{code - 0xDC00:02x}" if 0xDC80 <= code <= 0xDCFF else f"character U+{code:04X}"
        raise argparse.ArgumentTypeError(f"must be valid UTF-8 text ({shown} at position {err.start} is not): pass "
                                         "it in the terminal's UTF-8 encoding") from None
    return text


def _float(text: str, rule: str, fix: str, holds) -> float:
    """`text` as a float for which `holds(value)`, else an `ArgumentTypeError` with the rule and the fix."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and holds(value)):
        raise argparse.ArgumentTypeError(f"must be {rule}, got {text!r}: {fix}")
    return value


def sampling_temperature(text: str) -> float:
    """argparse type of `--temperature`: a finite number > 0 (transformers' `TemperatureLogitsWarper` rule)."""
    return _float(text, "a number > 0", "pass e.g. 0.7 with --do-sample (greedy decoding takes no --temperature)",
                  lambda value: value > 0)


def top_p(text: str) -> float:
    """argparse type of `--top-p`: a probability in (0, 1] (1 keeps every token; transformers skips a larger one
    without a word)."""
    return _float(text, "a number in (0, 1]", "pass e.g. 0.9 (1 keeps every token)", lambda value: 0 < value <= 1)


def int_list(flag: str, text: str) -> list[int]:
    """`"4,8,16"` -> `[4, 8, 16]`; each item an integer >= 1.

    Raises:
        UsageError: an item that is not an integer >= 1, naming `flag`.
    """
    try:
        values = [int(item) for item in text.split(",")]
    except ValueError:
        raise UsageError(flag, f"expects comma-separated integers such as 4,8,16, got {text!r}") from None
    if not values or min(values) < 1:
        raise UsageError(flag, f"expects integers >= 1 such as 4,8,16, got {text!r}")
    return values


def float_list(flag: str, text: str, low: float = 0.0, high: float = 1.0) -> list[float]:
    """`"0.9,0.7"` -> `[0.9, 0.7]`; each item in (low, high].

    Raises:
        UsageError: an item that is not a number in (low, high], naming `flag`.
    """
    try:
        values = [float(item) for item in text.split(",")]
    except ValueError:
        raise UsageError(flag, f"expects comma-separated numbers such as 0.9,0.7, got {text!r}") from None
    if not values or not all(low < v <= high for v in values):
        raise UsageError(flag, f"expects numbers in ({low:g}, {high:g}] such as 0.9,0.7, got {text!r}")
    return values
