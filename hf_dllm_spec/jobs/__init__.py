"""The jobs behind the command line (`hf-dllm-spec main | bench | bench-batch`), importable and callable.

Each module has `add_arguments(parser)`, `run(args, argv)` and `main(argv=None)`; `hf_dllm_spec.cli` mounts
them as subcommands, `./run.sh` calls the console script, and the scripts in `examples/` and `benchmarks/`
call `main()`. They evaluate the bundled model `models/sdar-tiny-arith` of the source checkout by default.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
from typing import Callable

from ..evaluation import DEFAULT_MODEL


def add_model_argument(parser: argparse.ArgumentParser, help: str = "checkpoint directory (SDAR layout)") -> None:
    """`--model PATH`, defaulting to the bundled model of the source checkout."""
    parser.add_argument("--model", default=str(DEFAULT_MODEL), metavar="PATH",
                        help=f"{help}; default: the bundled model models/sdar-tiny-arith")


#: `--dtype` choices: the model's parameter and activation dtype (bfloat16 is the fast CPU path).
DTYPES = ("float32", "bfloat16", "float16")


def add_dtype_argument(parser: argparse.ArgumentParser) -> None:
    """`--dtype {float32,bfloat16,float16}`, the dtype models load in (default float32); logits the acceptance
    tests read are float32 whatever it is."""
    parser.add_argument("--dtype", default="float32", choices=DTYPES,
                        help="dtype the models load in (default float32; bfloat16 is faster on CPU)")


def check_model(parser: argparse.ArgumentParser, model: str) -> None:
    """Stop with a usage error when the bundled model is asked for but the install has no source checkout."""
    if model == str(DEFAULT_MODEL) and not pathlib.Path(model).is_dir():
        parser.error(f"the bundled model is not at {model} (it ships with the source checkout, installed with "
                     "`pip install -e`); pass --model PATH")


def job_main(prog: str, description: str, add_arguments: Callable, run: Callable, argv: list[str] | None) -> None:
    """Parse a job's arguments, check the model path and run it; `argv` (the job's own arguments, default
    `sys.argv[1:]`) is recorded by the jobs that write results."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    add_arguments(parser)
    args = parser.parse_args(argv)
    check_model(parser, args.model)
    run(args, sys.argv[1:] if argv is None else argv)
