"""The jobs behind the command line (`hf-dllm-spec main | bench | bench-batch`), importable and callable.

Each module has `add_arguments(parser)`, `run(args, argv)` and `main(argv=None)`; `hf_dllm_spec.cli` mounts
them as subcommands, `./run.sh` calls the console script, and the scripts in `examples/` and `benchmarks/`
call `main()`. They evaluate the bundled model `models/sdar-tiny-arith` of the source checkout by default.
"""

from __future__ import annotations

import argparse
import pathlib

from ..evaluation import DEFAULT_MODEL


def add_model_argument(parser: argparse.ArgumentParser, help: str = "checkpoint directory (SDAR layout)") -> None:
    """`--model PATH`, defaulting to the bundled model of the source checkout."""
    parser.add_argument("--model", default=str(DEFAULT_MODEL), metavar="PATH",
                        help=f"{help}; default: the bundled model models/sdar-tiny-arith")


def check_model(parser: argparse.ArgumentParser, model: str) -> None:
    """Stop with a usage error when the bundled model is asked for but the install has no source checkout."""
    if model == str(DEFAULT_MODEL) and not pathlib.Path(model).is_dir():
        parser.error(f"the bundled model is not at {model} (it ships with the source checkout, installed with "
                     "`pip install -e`); pass --model PATH")
