"""The `hf-dllm-spec` command line: generate, the main job, the benchmarks and checkpoint export.

    hf-dllm-spec generate --prompt "Question: Tom has 3 apples. ..." --strategy s2d2 --block-size 4 --stats
    hf-dllm-spec generate --prompt "def add(a, b):" --strategy s2d2 --preset sdar-4b-config-a --stream
    hf-dllm-spec main --num-arith 10           # the main job (`./run.sh main` runs it too)
    hf-dllm-spec bench                         # the sweep -> runs/bench-<date>-<time>/sweep.{md,json}, frontier.png
    hf-dllm-spec bench-batch                   # batch of 8 against 8 sequential calls, writes batch.md
    hf-dllm-spec bench-gpu                     # GPU: static runtime vs stock AR -> runs/bench-gpu-<date>-<time>/
    hf-dllm-spec check-gpu                     # GPU: static runtime == eager, captured, flat memory (exit 0/1)
    hf-dllm-spec export SOURCE OUTPUT_DIR      # hf_dllm_spec.hub.export.export_checkpoint
    hf-dllm-spec strategies                    # the strategies, their parameters and presets

The strategy parameters of `generate` are options built from the config dataclasses of the registered
strategies (`hf_dllm_spec.strategies.registry.STRATEGIES`, `strategy.config_class`): every field is an option
(`--block-size` or `--block_size`), typed by its annotation (`int | None` takes `none`, a `bool` takes
true/false or nothing for true). Only the options given are passed to `generate`, on top of `--preset`;
the library validates them and its error is the command's error.

Errors: one path for every subcommand. A bad argument prints `hf-dllm-spec CMD: error: argument FLAG: MESSAGE`
(the library's message, the option named as typed on the command line) on stderr and exits with status 2,
without a traceback; `--debug` (anywhere on the line) re-raises the error with its traceback instead.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import shutil
import sys
import typing
from typing import Any, Callable, Sequence

from .cli_args import (CACHE_IMPLEMENTATIONS, UsageError, did_you_mean, non_negative_int, positive_int,
                       prompt_text, sampling_temperature, suggest, top_p)
from .tools.jobs import add_model_argument, check_model
from .serving.loading import add_loading_arguments

PARAM_PREFIX = "strategy_param:"
_RAW = argparse.RawDescriptionHelpFormatter


class Parser(argparse.ArgumentParser):
    """`ArgumentParser` whose errors are one line and a pointer to `--help` (no usage dump), status 2."""

    def error(self, message: str):
        """Print `PROG: error: MESSAGE` and a pointer to `PROG --help` on stderr, then exit with status 2.

        Args:
            message (`str`): what argparse (or a subcommand) found wrong.

        Raises:
            SystemExit: always, with status 2 (through `ArgumentParser.exit`).
        """
        self.exit(2, f"{self.prog}: error: {message}\n(`{self.prog} --help` lists the options)\n")


# ----------------------------------------------------------------------------------------------------------------
# Strategy parameters -> options, from the config dataclasses


def _converter(annotation: Any) -> tuple[Callable[[str], Any], bool]:
    """(text -> value, is_bool) for a field annotation: int, float, str, bool, `X | None`, Literal[...]."""
    args = typing.get_args(annotation)
    optional = type(None) in args
    base = annotation
    if typing.get_origin(annotation) is typing.Literal:
        base = type(args[0])
    elif args:
        rest = [a for a in args if a is not type(None)]
        base = rest[0] if len(rest) == 1 else str
        if typing.get_origin(base) is typing.Literal:
            base = type(typing.get_args(base)[0])
    if base not in (int, float, str, bool):
        base = str

    def convert(text: str) -> Any:
        if optional and text.strip().lower() == "none":
            return None
        if base is bool:
            from transformers.hf_argparser import string_to_bool

            return string_to_bool(text)
        return base(text)

    convert.__name__ = base.__name__ + (" or none" if optional else "")   # argparse: "invalid int value: 'x'"
    return convert, base is bool


def _owner(cls: type, name: str) -> type:
    """The most basic dataclass in `cls`'s MRO that declares field `name` (its options' group)."""
    owner = cls
    for klass in cls.__mro__:
        if name in getattr(klass, "__annotations__", {}) and dataclasses.is_dataclass(klass):
            owner = klass
    return owner


def _doc_text(cls: type, name: str) -> str:
    """What a config docstring says of `name` (its "name (`type`, ...): text" entry, continuation lines joined)."""
    for klass in cls.__mro__:
        lines = (klass.__doc__ or "").splitlines()
        for i, line in enumerate(lines):
            m = re.match(rf"^(\s*){re.escape(name)} \(`[^)]*\):\s*(.*)$", line)
            if not m:
                continue
            indent, text = len(m.group(1)), [m.group(2)]
            for more in lines[i + 1:]:
                if not more.strip() or len(more) - len(more.lstrip()) <= indent:
                    break
                text.append(more.strip())
            return " ".join(text).rstrip(".").replace("%", "%%")
    return ""


def strategy_parameters() -> dict[str, dict[str, Any]]:
    """name -> {annotation, annotations (per strategy), owner, strategies, defaults, config} over every registered
    strategy config."""
    from .strategies.registry import STRATEGIES

    out: dict[str, dict[str, Any]] = {}
    for strategy_name, strategy in tuple(STRATEGIES.items()):
        config = strategy.config_class
        hints = typing.get_type_hints(config)
        for f in dataclasses.fields(config):
            if f.name in config.unused_fields:
                continue
            entry = out.setdefault(f.name, {"annotation": hints[f.name], "owner": _owner(config, f.name),
                                            "strategies": [], "defaults": [], "config": config, "annotations": {}})
            entry["strategies"].append(strategy_name)
            entry["annotations"][strategy_name] = hints[f.name]
            default = f.default if f.default is not dataclasses.MISSING else None
            if default not in entry["defaults"]:
                entry["defaults"].append(default)
    return out


def add_strategy_parameters(parser: argparse.ArgumentParser) -> None:
    """One option per strategy parameter, grouped by the config class that declares it; unset ones are absent."""
    groups: dict[type, argparse._ArgumentGroup] = {}
    for name, entry in strategy_parameters().items():
        owner = entry["owner"]
        if owner not in groups:
            groups[owner] = parser.add_argument_group(
                f"strategy parameters ({owner.__name__})",
                "only the ones given are passed to generate; the strategy's defaults (and --preset) fill the rest")
        convert, is_bool = _converter(entry["annotation"])
        if len(set(entry["annotations"].values())) > 1:     # typed per strategy: read as text, converted later
            convert, is_bool = _as_text, False
        default = (f"default {entry['defaults'][0]!r}" if len(entry["defaults"]) == 1
                   else "default per strategy")
        if type(None) in typing.get_args(entry["annotation"]):
            default += ", 'none' for None"
        help_text = "; ".join(filter(None, [_doc_text(entry["config"], name), default,
                                            "strategies: " + ", ".join(entry["strategies"])]))
        flags = [f"--{name.replace('_', '-')}"] + ([f"--{name}"] if "_" in name else [])
        kwargs: dict[str, Any] = dict(dest=PARAM_PREFIX + name, type=convert, default=argparse.SUPPRESS,
                                      help=help_text, metavar=convert.__name__.split()[0].upper())
        if is_bool:
            kwargs.update(nargs="?", const=True, metavar="BOOL")
        try:
            groups[owner].add_argument(*flags, **kwargs)
        except argparse.ArgumentError:     # a parameter named like a generation option: set it with the latter
            continue


def given_strategy_parameters(args: argparse.Namespace) -> dict[str, Any]:
    """The strategy-parameter options given on the command line (:func:`add_strategy_parameters`).

    Args:
        args (`argparse.Namespace`): the parsed `generate` arguments.

    Returns:
        `dict[str, Any]`: parameter name -> converted value, for the options given only (an option not on the
        command line is absent from `args`, so the strategy's defaults and `--preset` fill it). A parameter whose
        type differs between strategies is converted by the chosen `--strategy`'s annotation.

    Raises:
        UsageError: such a parameter's text is not a value of that annotation.
    """
    given = {k[len(PARAM_PREFIX):]: v for k, v in vars(args).items() if k.startswith(PARAM_PREFIX)}
    typed_per_strategy = {name: entry["annotations"] for name, entry in strategy_parameters().items()
                          if name in given and len(set(entry["annotations"].values())) > 1}
    for name, per_strategy in typed_per_strategy.items():
        annotation = per_strategy.get(getattr(args, "strategy", None))
        if annotation is None:
            continue                     # not a parameter of the chosen strategy: its config refuses it
        convert, _ = _converter(annotation)
        try:
            given[name] = convert(given[name])
        except ValueError as err:
            raise UsageError(f"--{name.replace('_', '-')}", f"invalid {convert.__name__} value for --strategy "
                             f"{args.strategy}: {given[name]!r}") from err
    return given


def _as_text(text: str) -> str:
    """argparse type of a parameter whose type differs between strategies: the text, converted once the strategy
    is known (:func:`given_strategy_parameters`)."""
    return text


_as_text.__name__ = "value"


# ----------------------------------------------------------------------------------------------------------------
# Subcommands


def _strategy_name(text: str) -> str:
    """argparse type of `--strategy`: a registered strategy, else an error with the closest name."""
    from .strategies.registry import STRATEGIES

    if text not in STRATEGIES:
        raise argparse.ArgumentTypeError(f"unknown strategy {text!r}{did_you_mean(text, STRATEGIES)}; choose from "
                                         + ", ".join(STRATEGIES))
    return text


def _add_generate(sub) -> None:
    from .strategies.registry import STRATEGIES

    p = sub.add_parser("generate", help="decode a prompt with any strategy and parameters",
                       usage="%(prog)s --prompt TEXT [--strategy NAME] [--preset NAME] [--model PATH] [options]",
                       description="Decode one prompt with `model.generate(..., decoding_strategy=...)` and print the "
                                   "new text (stdout); --stats prints the speculative-decoding statistics (stderr).",
                       epilog="example: hf-dllm-spec generate --prompt 'def add(a, b):' --strategy s2d2 "
                              "--block-size 4 --min-ssd-span-length 1 --cache-ver --stats")
    p.add_argument("--prompt", required=True, type=prompt_text, help="the prompt text")
    p.add_argument("--strategy", default="s2d2", type=_strategy_name, metavar="NAME",
                   help="decoding_strategy: " + ", ".join(STRATEGIES) + " (default s2d2)")
    p.add_argument("--preset", default=None, help="a named configuration of the strategy (see `hf-dllm-spec "
                                                  "strategies`); options given override its fields")
    add_model_argument(p)
    p.add_argument("--draft-model", default=None, metavar="PATH", help="drafter checkpoint, for strategies that "
                                                                      "use one (DEER on an AR --model, SimSD)")
    p.add_argument("--mask-token-id", type=non_negative_int, default=None, metavar="ID",
                   help="the model's mask token, where its config has none (diffusion weights in the Qwen layout)")
    p.add_argument("--draft-mask-token-id", type=non_negative_int, default=None, metavar="ID",
                   help="the drafter's mask token, where its config has none")
    p.add_argument("--max-new-tokens", type=positive_int, default=64, help="default 64")
    p.add_argument("--do-sample", action="store_true", help="sample (default: greedy)")
    p.add_argument("--temperature", type=sampling_temperature, default=None)
    p.add_argument("--top-p", type=top_p, default=None)
    p.add_argument("--top-k", type=non_negative_int, default=None, help="0 keeps every token")
    p.add_argument("--seed", type=_seed, default=0,
                   help="seed of the torch.Generator passed to generate, in [0, 2**64) (default 0)")
    add_loading_arguments(p)               # --dtype, --device, --device-map, --quantization, --draft-device
    p.add_argument("--cache-implementation", default=None, choices=CACHE_IMPLEMENTATIONS,
                   help="transformers' name: `static` runs the static runtime (preallocated cache; CUDA graphs on a "
                        "GPU); default: the eager runtime")
    p.add_argument("--stream", action="store_true",
                   help="print the text as tokens become final; in a terminal, also the current block's drafts "
                        "(TextDiffusionStreamer)")
    p.add_argument("--stats", action="store_true", help="print the spec-decoding statistics to stderr")
    add_strategy_parameters(p)
    p.set_defaults(handler=_generate, parser=p)


def _stats_table(stats) -> str:
    """The spec-decoding statistics of one call as a small table with units; missing values print as "-"."""
    def number(value, fmt):
        return "-" if value is None or value != value else format(value, fmt)

    rows = [("new tokens", str(stats.num_generated_tokens), "tokens"),
            ("forwards (NFE)", str(stats.nfe), "forwards"),
            ("tokens per forward", number(stats.tpf, ".2f"), "tokens/forward"),
            ("wall time", number(stats.wall_time_s, ".3f"), "s"),
            ("throughput", number(stats.num_generated_tokens / stats.wall_time_s if stats.wall_time_s else None,
                                  ".1f"), "tokens/s")]
    if stats.num_draft_tokens:
        rows += [("acceptance rate", number(stats.acceptance_rate, ".2f"), "accepted / drafted tokens"),
                 ("tau", number(stats.mean_acceptance_length, ".2f"), "tokens committed per verify")]
    if stats.num_edited_tokens:
        rows.append(("edited", number(100 * stats.edit_rate, ".1f"), "% of committed tokens"))
    if stats.warmup_time_s:
        rows.append(("warm-up", number(stats.warmup_time_s, ".3f"), "s (graph capture / compilation, in wall time)"))
    width = max(len(name) for name, _, _ in rows)
    values = max(len(value) for _, value, _ in rows)
    table = "\n".join(f"  {name:<{width}}  {value:>{values}}  {unit}" for name, value, unit in rows)
    return table + (f"\n  runtime: {stats.runtime}" if stats.runtime else "")


def _generate(args: argparse.Namespace, argv: list[str]) -> None:
    import torch

    from .integration.generate import dllm_generate
    from .integration.mixin import DllmGenerationMixin
    from .runtime.weights import execution_device
    from .serving.loading import LoadOptions, load_models
    from .strategies.registry import resolve_config

    params = given_strategy_parameters(args)
    resolve_config(args.strategy, preset=args.preset, overrides=params)  # a bad parameter fails before loading
    check_model(args.parser, args.model)
    if args.draft_model is not None:
        check_model(args.parser, args.draft_model, "--draft-model")
    tokenizer, model, drafter = load_models(args.model, args.draft_model, LoadOptions.from_args(args))
    extra: dict[str, Any] = {}
    if not isinstance(model, DllmGenerationMixin):   # a stock transformers class (an AR target): the strategies
        extra["custom_generate"] = dllm_generate      # through transformers' custom_generate hook
    if drafter is not None:
        extra["draft_model"] = drafter
    for name in ("temperature", "top_p", "top_k", "mask_token_id", "draft_mask_token_id"):
        if getattr(args, name) is not None:
            extra[name] = getattr(args, name)
    if args.preset is not None:
        extra["preset"] = args.preset
    if args.cache_implementation is not None:
        extra["cache_implementation"] = args.cache_implementation
    streamer = None
    if args.stream:   # in a terminal, the current block's drafts too (redrawn in place); piped: final text only
        from transformers import TextDiffusionStreamer, TextStreamer

        streamer_class = TextDiffusionStreamer if sys.stdout.isatty() else TextStreamer
        streamer = streamer_class(tokenizer, skip_prompt=True, skip_special_tokens=True)
    device = execution_device(model)                  # not model.device: "meta" under accelerate offload
    enc = tokenizer(args.prompt, return_tensors="pt").to(device)
    out = model.generate(enc.input_ids, attention_mask=enc.attention_mask, decoding_strategy=args.strategy,
                         max_new_tokens=args.max_new_tokens, do_sample=args.do_sample,
                         generator=torch.Generator(device).manual_seed(args.seed), streamer=streamer,
                         return_dict_in_generate=True, **extra, **params)
    stats = out.spec_stats_per_row[0]
    new = out.sequences[0, enc.input_ids.shape[1]:][: stats.num_generated_tokens]
    if not args.stream:
        print(tokenizer.decode(new, skip_special_tokens=True))
    if args.stats:
        print(f"spec stats ({args.strategy}):", file=sys.stderr)
        print(_stats_table(out.spec_stats), file=sys.stderr)


def _add_job(sub, name: str, module, help_text: str) -> None:
    p = sub.add_parser(name, help=help_text, description=module.__doc__, formatter_class=_RAW)
    module.add_arguments(p)
    p.set_defaults(handler=_run_job, job=module, parser=p)


def _run_job(args: argparse.Namespace, argv: list[str]) -> None:
    check_model(args.parser, args.model)
    args.job.run(args, ["hf-dllm-spec", args.command, *argv])


def _add_export(sub) -> None:
    p = sub.add_parser("export", help="export a checkpoint (hf_dllm_spec.hub.export.export_checkpoint)",
                       description="Export a checkpoint directory with hf_dllm_spec.hub.export.export_checkpoint: "
                                   "the copy loads with AutoModelForCausalLM.from_pretrained(dir, "
                                   "trust_remote_code=True) alone.")
    p.add_argument("source", help="the checkpoint directory to export")
    p.add_argument("output_dir", help="where the exported checkpoint is written (SOURCE itself: in place)")
    p.add_argument("--overwrite", action="store_true", help="allow writing into a non-empty OUTPUT_DIR")
    p.set_defaults(handler=_export, parser=p)


def _export(args: argparse.Namespace, argv: list[str]) -> None:
    try:
        from .hub.export import export_checkpoint
    except ImportError as err:
        args.parser.error(f"checkpoint export is not available in this install ({err})")
    try:
        result = export_checkpoint(args.source, args.output_dir, **({"overwrite": True} if args.overwrite else {}))
    except (ValueError, OSError) as err:   # the library's words for Python arguments -> the flags
        message = str(err)
        for python, flag in (("pass overwrite=True", "pass --overwrite"), ("`output_dir`", "OUTPUT_DIR"),
                             ("`source`", "SOURCE"), ("pass the model object, or the directory", "pass the directory")):
            message = message.replace(python, flag)
        if isinstance(err, shutil.Error):              # copytree's list of (source, target, why): the first
            source, _, why = err.args[0][0]
            message, written = f"{source} could not be copied ({why}); fix or remove it in SOURCE", False
        else:                                          # an error of the files written, not of the ones read
            written = isinstance(err, OSError) and not str(getattr(err, "filename", "") or "").startswith(
                str(args.source))
        flag = "OUTPUT_DIR" if "OUTPUT_DIR" in message or written else "SOURCE"
        message = re.sub(r"^\(=(.*?)\) must ", r"\1 must ", message.removeprefix(flag + " "))   # 'x' must ...
        raise UsageError(flag, message) from err
    print(f"exported {args.source} -> {result if result is not None else args.output_dir}")


#: The GPU defaults of the cost model. The outside time is measured over 64 new tokens, 5 times (the cost model's
#: 16 tokens twice left a spread between the AR rows of one H200 session, 0.24-0.36 ms/step, as large as the
#: changes it was to show).
BENCH_GPU_DEFAULTS = {"device": "cuda", "dtype": "bfloat16", "runtime": "static", "count_device": None,
                      "count_runtime": "static", "shape": "1.7b", "out": None, "outside_tokens": 64,
                      "outside_reps": 5}
BENCH_GPU_SMOKE = ("hf-dllm-spec bench-gpu --device cpu --dtype float32 --shape tiny --groups sdar --num-prompts 1 "
                   "--threads 1")


def _add_bench_gpu(sub) -> None:
    from .tools.cost_model import cli as cost_model_cli

    p = sub.add_parser("bench-gpu", help="GPU benchmark: the static runtime against stock transformers' compiled AR",
                       formatter_class=_RAW,
                       description="The cost model (benchmarks/cost_model.py) with GPU defaults: --device cuda "
                                   "--dtype bfloat16 --runtime static --count-runtime static --shape 1.7b "
                                   "--outside-tokens 64 --outside-reps 5, COUNT on "
                                   "--device unless --count-device says otherwise. Times every forward width through "
                                   "the static runtime (CUDA graphs; --runtime compiled: compiled by "
                                   "compile_config=CompileConfig()), stock transformers generate(cache_implementation"
                                   "='static') greedy AR in the same process, and prints each target of issue 25 with "
                                   "met / not met. Writes a new folder runs/bench-gpu-<date>-<time>/ unless --out "
                                   "names one (the committed results only with --out benchmarks/results/...).",
                       epilog="examples:\n  hf-dllm-spec bench-gpu      # on a GPU: 1.7B shapes, all groups\n  "
                              + BENCH_GPU_SMOKE + "      # the CPU smoke run")
    cost_model_cli.add_arguments(p, BENCH_GPU_DEFAULTS)
    p.set_defaults(handler=_bench_gpu, parser=p)


def _bench_gpu(args: argparse.Namespace, argv: list[str]) -> None:
    """`hf-dllm-spec bench-gpu`: `hf_dllm_spec.tools.cost_model.cli.run` with the GPU defaults; no CUDA device for
    --device / --count-device is a usage error (exit 2) that names the CPU smoke command."""
    import shlex

    from .tools.cost_model import cli as cost_model_cli
    from .tools.jobs import fresh_out_dir

    if args.count_device is None:
        args.count_device = args.device
    if args.out is None:
        args.out = str(fresh_out_dir("bench-gpu"))
    cost_model_cli.run(args, shlex.join(["hf-dllm-spec", "bench-gpu", *argv]), cpu_hint="run the CPU smoke: "
                       + BENCH_GPU_SMOKE)


def _add_check_gpu(sub) -> None:
    from .tools.cost_model import check_gpu

    p = sub.add_parser("check-gpu", help="GPU: is the static runtime (CUDA graphs) on the fast path and exact here?",
                       formatter_class=_RAW, description=check_gpu.__doc__.split("\n\n", 1)[1].split("\n\nSource")[0])
    check_gpu.add_arguments(p)
    p.set_defaults(handler=_check_gpu, parser=p)


def _check_gpu(args: argparse.Namespace, argv: list[str]) -> None:
    """`hf-dllm-spec check-gpu`: exit 0 when every check holds, 1 when one does not, 2 without a CUDA device."""
    from .tools.cost_model import check_gpu

    sys.exit(check_gpu.main(args))


def _add_strategies(sub) -> None:
    p = sub.add_parser("strategies", help="list the strategies, their parameters and presets",
                       description="The registered decoding strategies, their parameters (defaults) and presets.")
    p.set_defaults(handler=_strategies, parser=p)


def _strategies(args: argparse.Namespace, argv: list[str]) -> None:
    from .strategies.registry import STRATEGIES

    for name, strategy in STRATEGIES.items():
        config = strategy.config_class()
        print(f"{name} ({type(config).__name__})")
        print("  parameters: " + ", ".join(f"{k}={v!r}" for k, v in dataclasses.asdict(config).items()))
        if strategy.config_class.presets:
            print("  presets: " + ", ".join(strategy.config_class.presets))


def build_parser() -> argparse.ArgumentParser:
    """The `hf-dllm-spec` parser: `--version`, `--debug` and every subcommand (generate, main, bench, bench-batch,
    bench-gpu, check-gpu, serve, export, strategies). Loads the installed strategy plugins first, so that their
    parameters become options of `generate`.

    Returns:
        :class:`Parser`: each subcommand's namespace carries its `handler` and its own `parser`.
    """
    from . import __version__
    from .tools.jobs import batch, main as main_job, sweep
    from .serving import cli as serve
    from .strategies.registry import load_strategy_plugins

    load_strategy_plugins()            # installed third-party strategies become options and server strategies
    doc = __doc__.split("\n\n")
    parser = Parser(prog="hf-dllm-spec", description=doc[0], epilog="examples:\n" + doc[1], formatter_class=_RAW)
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    parser.add_argument("--debug", action="store_true", help="show the traceback of an error (anywhere on the line)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    _add_generate(sub)
    _add_job(sub, "main", main_job, "the main job: AR, dynamic and S2D2 on prompt sets, tables (bundled model)")
    _add_job(sub, "bench", sweep, "the benchmark sweep: block size x unmasking rule x S2D2 preset against AR")
    _add_job(sub, "bench-batch", batch, "benchmark: one batched call against sequential calls, tokens/s")
    _add_bench_gpu(sub)
    _add_check_gpu(sub)
    _add_job(sub, "serve", serve, "an OpenAI-compatible server over the strategies (extra `serve`)")
    _add_export(sub)
    _add_strategies(sub)
    return parser


def _flag_of(message: str, parser: argparse.ArgumentParser) -> str | None:
    """The option a library message is about: its leading "`name` (=...)" when `name` is a strategy parameter,
    `preset`, or a `generate` argument the subcommand has as `--name-with-dashes` (`max_new_tokens`,
    `draft_model`, `do_sample`, ...)."""
    m = re.match(r"`(\w+)` \(=", message)
    if m is None:
        return None
    flag = "--" + m.group(1).replace("_", "-")
    if m.group(1) in strategy_parameters() or m.group(1) == "preset" or flag in parser._option_string_actions:
        return flag
    return None


#: A library message's Python fixes and the option of the subcommand that says the same (used when it has it).
_CLI_TERMS = (("draft_model=<", "--draft-model <", "--draft-model"), ("draft_model=", "--draft-model", "--draft-model"),
              ("draft_mask_token_id=<id>", "--draft-mask-token-id ID", "--draft-mask-token-id"),
              ("mask_token_id=<id>", "--mask-token-id ID", "--mask-token-id"),
              ("max_new_tokens", "--max-new-tokens", "--max-new-tokens"),
              ("do_sample=False", "no --do-sample", "--do-sample"), ("do_sample=True", "--do-sample", "--do-sample"))


def _cli_terms(message: str, parser: argparse.ArgumentParser) -> str:
    """A library message with its Python fixes said in the subcommand's options (`max_new_tokens` ->
    `--max-new-tokens`, `draft_model=` -> `--draft-model`, ...), for the options the subcommand has."""
    for python, cli, option in _CLI_TERMS:
        if option in parser._option_string_actions:
            message = message.replace(python, cli)
    return message


def _seed(text: str) -> int:
    """`--seed`: an integer `torch.Generator.manual_seed` takes, in [0, 2**64)."""
    value = int(text)
    if not 0 <= value < 2 ** 64:
        raise argparse.ArgumentTypeError(f"must be in [0, 2**64) (a torch.Generator seed), got {value}")
    return value


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of the `hf-dllm-spec` console script: parse, run the subcommand, and turn a bad argument into
    one line on stderr and exit status 2 (see the module docstring; `--debug` keeps the traceback)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    argv = [a for a in argv if a != "--debug"]
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:                 # the subcommand's error, with the closest of its options for a misspelt one
        own = getattr(args, "parser", parser)
        hints = "".join(did_you_mean(word.split("=")[0], own._option_string_actions)
                        for word in unknown if word.startswith("--"))
        own.error(f"unrecognized arguments: {' '.join(unknown)}{hints}")
    # The subcommand's own arguments (recorded by the benchmarks as their command line).
    rest = argv[argv.index(args.command) + 1:]
    try:
        args.handler(args, rest)
    except BrokenPipeError:     # the reader went away (`| head`): stop quietly, as other command-line tools do
        try:                    # Python's final flush of stdout must not fail again
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except (OSError, ValueError):       # a stdout without a file descriptor
            pass
        raise SystemExit(1) from None
    except (UsageError, ValueError, OSError, NotImplementedError) as err:
        if debug:
            raise
        message = suggest(str(err).strip())
        flag = None if isinstance(err, UsageError) else _flag_of(message, args.parser)
        message = _cli_terms(message, args.parser)
        if flag is not None:
            message = f"argument {flag}: {message}"
        args.parser.exit(2, f"{args.parser.prog}: error: {message}\n(run with --debug for the traceback)\n")


if __name__ == "__main__":
    main()
