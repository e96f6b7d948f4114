"""The jobs behind the command line (`hf-dllm-spec main | bench | bench-batch`), importable and callable.

Each module has `add_arguments(parser)`, `run(args, argv)` and `main(argv=None)`; `hf_dllm_spec.cli` mounts
them as subcommands, `./run.sh` calls the console script, and the scripts in `examples/` and `benchmarks/`
call `main()`. They evaluate the bundled model `models/sdar-tiny-arith` of the source checkout by default.
"""

from __future__ import annotations

import argparse
import difflib
import pathlib
import re
import sys
import time
from typing import Callable, Iterable

from .evaluation import DEFAULT_MODEL


def add_model_argument(parser: argparse.ArgumentParser, help: str = "checkpoint directory (SDAR layout)") -> None:
    """`--model PATH`, defaulting to the bundled model of the source checkout."""
    parser.add_argument("--model", default=str(DEFAULT_MODEL), metavar="PATH",
                        help=f"{help}; default: the bundled model models/sdar-tiny-arith")


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


def fresh_out_dir(kind: str) -> pathlib.Path:
    """`runs/<kind>-<YYYYmmdd-HHMMSS>` under the working directory: a new folder per run (`runs/` is ignored by
    git), so a trial never overwrites the committed results in `benchmarks/results/`."""
    return pathlib.Path("runs") / f"{kind}-{time.strftime('%Y%m%d-%H%M%S')}"


def check_model(parser: argparse.ArgumentParser, model: str, flag: str = "--model") -> None:
    """Refuse a `--model` that cannot be a checkpoint before anything loads.

    Raises:
        UsageError: the bundled model is asked for but the install has no source checkout; or a path that is no
            directory and cannot be a Hub repository id (`org/name`).
    """
    path = pathlib.Path(model)
    if model == str(DEFAULT_MODEL) and not path.is_dir():
        raise UsageError(flag, f"the bundled model is not at {model} (it ships with the source checkout, installed "
                               "with `pip install -e <checkout>`); pass --model PATH")
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise UsageError(flag, f"{model!r} is a directory without a config.json; pass a checkpoint directory "
                                   "(what save_pretrained writes), e.g. models/sdar-tiny-arith")
        return
    if path.parent.is_dir() and str(path.parent) not in ("", "."):   # models/typo: a local folder, mistyped
        siblings = [p.name for p in path.parent.iterdir() if (p / "config.json").is_file()]
        raise UsageError(flag, f"no checkpoint directory at {model!r}{did_you_mean(path.name, siblings)}; "
                               f"checkpoints in {path.parent}/: {', '.join(sorted(siblings)) or 'none'}")
    hub_id = model.count("/") == 1 and not model.startswith((".", "/", "~")) and all(model.split("/"))
    if not hub_id:
        raise UsageError(flag, f"no checkpoint directory at {model!r}; pass a directory such as "
                               "models/sdar-tiny-arith (the bundled models are in models/) or a Hub id org/name")


def load_checkpoint(path: str, dtype, flag: str = "--model"):
    """`(tokenizer, model)` of `path` (:func:`hf_dllm_spec.jobs.evaluation.load`).

    Raises:
        UsageError: the checkpoint cannot be loaded (e.g. a Hub id offline), naming `flag`, with the first line of
            transformers' message.
    """
    from .evaluation import load

    try:
        return load(path, dtype=dtype)
    except OSError as err:
        raise UsageError(flag, f"cannot load {path!r}: {str(err).strip().splitlines()[0]}") from err


def job_main(prog: str, description: str, add_arguments: Callable, run: Callable, argv: list[str] | None) -> None:
    """Parse a job's arguments, check the model path and run it; `argv` (the job's own arguments, default
    `sys.argv[1:]`), after the words of `prog`, is recorded by the jobs that write results as their command."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        check_model(parser, args.model)
        run(args, [*prog.split(), *(sys.argv[1:] if argv is None else argv)])
    except UsageError as err:
        parser.exit(2, f"{parser.prog}: error: {err}\n")
