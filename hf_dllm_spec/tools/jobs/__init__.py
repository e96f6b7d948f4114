"""The jobs behind the command line (`hf-dllm-spec main | bench | bench-batch`), importable and callable.

Each job module (`main`, `sweep`, `batch`) has `add_arguments(parser)`, `run(args, argv)` and `main(argv=None)`
(`evaluation` holds the prompt sets and scoring they share); `hf_dllm_spec.cli` mounts
them as subcommands, `./run.sh` calls the console script, and the scripts in `examples/` and `benchmarks/`
call `main()`. They evaluate the bundled model `models/sdar-tiny-arith` of the source checkout by default.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time
from typing import Callable

from ...cli_args import UsageError, did_you_mean
from .evaluation import DEFAULT_MODEL


def add_model_argument(parser: argparse.ArgumentParser,
                       help: str = "checkpoint directory or Hub id (any supported family)") -> None:
    """`--model PATH`, defaulting to the bundled model of the source checkout."""
    parser.add_argument("--model", default=str(DEFAULT_MODEL), metavar="PATH",
                        help=f"{help}; default: the bundled model models/sdar-tiny-arith")


def fresh_out_dir(kind: str) -> pathlib.Path:
    """`runs/<kind>-<YYYYmmdd-HHMMSS>` under the working directory: a new folder per run (`runs/` is ignored by
    git), so a trial never overwrites the committed results in `benchmarks/results/`."""
    return pathlib.Path("runs") / f"{kind}-{time.strftime('%Y%m%d-%H%M%S')}"


def make_out_dir(out: str | None, kind: str) -> pathlib.Path:
    """The results folder of a benchmark, made before anything loads or runs: `out`, else :func:`fresh_out_dir`.

    Raises:
        UsageError: naming `--out`, when a file is in the way (found at the end, the run's results were lost).
    """
    path = pathlib.Path(out) if out is not None else fresh_out_dir(kind)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError) as err:
        raise UsageError("--out", f"{path} must be a directory (a file is in the way: {err.strerror}); pass another "
                                  "--out") from None
    return path


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
                               f"checkpoints in {str(path.parent).rstrip('/')}/: "
                               f"{', '.join(sorted(siblings)) or 'none'}")
    hub_id = model.count("/") == 1 and not model.startswith((".", "/", "~")) and all(model.split("/"))
    if not hub_id:
        raise UsageError(flag, f"no checkpoint directory at {model!r}; pass a directory such as "
                               "models/sdar-tiny-arith (the bundled models are in models/) or a Hub id org/name")


def load_checkpoint(path: str, dtype, flag: str = "--model"):
    """`(tokenizer, model)` of `path` (:func:`hf_dllm_spec.tools.jobs.evaluation.load`).

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
