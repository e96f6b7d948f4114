"""The `hf-dllm-spec` command line: generate, the main job, the benchmarks and checkpoint export.

    hf-dllm-spec generate --prompt "Question: Tom has 3 apples. ..." --strategy s2d2 --block-size 8 --stats
    hf-dllm-spec generate --prompt "def add(a, b):" --strategy s2d2 --preset sdar-4b-config-a --stream
    hf-dllm-spec main --num-arith 10           # the main job (`./run.sh main` runs it too)
    hf-dllm-spec bench                         # the sweep, writes benchmarks/results/sweep.{md,json}, frontier.png
    hf-dllm-spec bench-batch                   # batch of 8 against 8 sequential calls, writes batch.md
    hf-dllm-spec export SOURCE OUTPUT_DIR      # hf_dllm_spec.export.export_checkpoint
    hf-dllm-spec strategies                    # the strategies, their parameters and presets

The strategy parameters of `generate` are options built from the config dataclasses of the registered
strategies (`hf_dllm_spec.registry.STRATEGIES`, `strategy.config_class`): every field is an option
(`--block-size` or `--block_size`), typed by its annotation (`int | None` takes `none`, a `bool` takes
true/false or nothing for true). Only the options given are passed to `generate`, on top of `--preset`;
the library validates them and its error is the command's error.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import sys
import typing
from typing import Any, Callable, Sequence

from .jobs import DTYPES, add_model_argument, check_model

PARAM_PREFIX = "strategy_param:"
_RAW = argparse.RawDescriptionHelpFormatter


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
    """name -> {annotation, owner, strategies, defaults, config} over every registered strategy config."""
    from .registry import STRATEGIES

    out: dict[str, dict[str, Any]] = {}
    for strategy_name, strategy in STRATEGIES.items():
        config = strategy.config_class
        hints = typing.get_type_hints(config)
        for f in dataclasses.fields(config):
            entry = out.setdefault(f.name, {"annotation": hints[f.name], "owner": _owner(config, f.name),
                                            "strategies": [], "defaults": [], "config": config})
            entry["strategies"].append(strategy_name)
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
    return {k[len(PARAM_PREFIX):]: v for k, v in vars(args).items() if k.startswith(PARAM_PREFIX)}


# ----------------------------------------------------------------------------------------------------------------
# Subcommands


def _add_generate(sub) -> None:
    from .registry import STRATEGIES

    p = sub.add_parser("generate", help="decode a prompt with any strategy and parameters",
                       description="Decode one prompt with `model.generate(..., decoding_strategy=...)` and print the "
                                   "new text (stdout); --stats prints the speculative-decoding statistics (stderr).",
                       epilog="example: hf-dllm-spec generate --prompt 'def add(a, b):' --strategy s2d2 "
                              "--block-size 8 --min-ssd-span-length 1 --cache-ver --stats")
    p.add_argument("--prompt", required=True, help="the prompt text")
    p.add_argument("--strategy", default="s2d2", choices=list(STRATEGIES), help="decoding_strategy (default s2d2)")
    p.add_argument("--preset", default=None, help="a named configuration of the strategy (see `hf-dllm-spec "
                                                  "strategies`); options given override its fields")
    add_model_argument(p)
    p.add_argument("--draft-model", default=None, metavar="PATH", help="drafter checkpoint, for strategies that "
                                                                      "use one")
    p.add_argument("--max-new-tokens", type=int, default=64, help="default 64")
    p.add_argument("--do-sample", action="store_true", help="sample (default: greedy)")
    p.add_argument("--temperature", type=float, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--seed", type=int, default=0, help="seed of the torch.Generator passed to generate (default 0)")
    p.add_argument("--dtype", default="float32", choices=DTYPES)
    p.add_argument("--device", default="cpu", help="e.g. cpu, cuda (default cpu)")
    p.add_argument("--stream", action="store_true", help="print the text as tokens become final (TextStreamer)")
    p.add_argument("--stats", action="store_true", help="print the spec-decoding statistics to stderr")
    add_strategy_parameters(p)
    p.set_defaults(handler=_generate, parser=p)


def _generate(args: argparse.Namespace, argv: list[str]) -> None:
    import torch

    from .evaluation import load
    from .registry import resolve_config

    parser: argparse.ArgumentParser = args.parser
    params = given_strategy_parameters(args)
    try:   # fail on a bad strategy parameter before loading anything
        resolve_config(args.strategy, preset=args.preset, overrides=params)
    except ValueError as err:
        parser.error(str(err))
    check_model(parser, args.model)
    tokenizer, model = load(args.model, dtype=getattr(torch, args.dtype))
    model.to(args.device)
    extra: dict[str, Any] = {}
    if args.draft_model is not None:
        extra["draft_model"] = load(args.draft_model, dtype=getattr(torch, args.dtype))[1].to(args.device)
    for name in ("temperature", "top_p", "top_k"):
        if getattr(args, name) is not None:
            extra[name] = getattr(args, name)
    if args.preset is not None:
        extra["preset"] = args.preset
    streamer = None
    if args.stream:
        from transformers import TextStreamer

        streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
    enc = tokenizer(args.prompt, return_tensors="pt").to(model.device)
    try:
        out = model.generate(enc.input_ids, attention_mask=enc.attention_mask, decoding_strategy=args.strategy,
                             max_new_tokens=args.max_new_tokens, do_sample=args.do_sample,
                             generator=torch.Generator(model.device).manual_seed(args.seed), streamer=streamer,
                             return_dict_in_generate=True, **extra, **params)
    except ValueError as err:
        parser.error(str(err))
    stats = out.spec_stats_per_row[0]
    new = out.sequences[0, enc.input_ids.shape[1]:][: stats.num_generated_tokens]
    if not args.stream:
        print(tokenizer.decode(new, skip_special_tokens=True))
    if args.stats:
        print(f"spec stats ({args.strategy}):", file=sys.stderr)
        for key, value in out.spec_stats.to_dict().items():
            value = f"{value:.4g}" if isinstance(value, float) else value
            print(f"  {key}: {value}", file=sys.stderr)


def _add_job(sub, name: str, module, help_text: str) -> None:
    p = sub.add_parser(name, help=help_text, description=module.__doc__, formatter_class=_RAW)
    module.add_arguments(p)
    p.set_defaults(handler=_run_job, job=module, parser=p)


def _run_job(args: argparse.Namespace, argv: list[str]) -> None:
    check_model(args.parser, args.model)
    args.job.run(args, argv)


def _add_export(sub) -> None:
    p = sub.add_parser("export", help="export a checkpoint (hf_dllm_spec.export.export_checkpoint)",
                       description="Export a checkpoint directory with hf_dllm_spec.export.export_checkpoint: "
                                   "the copy loads with AutoModelForCausalLM.from_pretrained(dir, "
                                   "trust_remote_code=True) alone.")
    p.add_argument("source", help="the checkpoint directory to export")
    p.add_argument("output_dir", help="where the exported checkpoint is written (SOURCE itself: in place)")
    p.add_argument("--overwrite", action="store_true", help="allow writing into a non-empty OUTPUT_DIR")
    p.set_defaults(handler=_export, parser=p)


def _export(args: argparse.Namespace, argv: list[str]) -> None:
    try:
        from .export import export_checkpoint
    except ImportError as err:
        args.parser.error(f"checkpoint export is not available in this install ({err})")
    try:
        result = export_checkpoint(args.source, args.output_dir, **({"overwrite": True} if args.overwrite else {}))
    except (ValueError, FileNotFoundError) as err:
        args.parser.error(str(err))
    print(f"exported {args.source} -> {result if result is not None else args.output_dir}")


def _add_strategies(sub) -> None:
    p = sub.add_parser("strategies", help="list the strategies, their parameters and presets",
                       description="The registered decoding strategies, their parameters (defaults) and presets.")
    p.set_defaults(handler=_strategies, parser=p)


def _strategies(args: argparse.Namespace, argv: list[str]) -> None:
    from .registry import STRATEGIES

    for name, strategy in STRATEGIES.items():
        config = strategy.config_class()
        print(f"{name} ({type(config).__name__})")
        print("  parameters: " + ", ".join(f"{k}={v!r}" for k, v in dataclasses.asdict(config).items()))
        if strategy.config_class.presets:
            print("  presets: " + ", ".join(strategy.config_class.presets))


def build_parser() -> argparse.ArgumentParser:
    from . import __version__
    from .jobs import batch, main as main_job, sweep

    doc = __doc__.split("\n\n")
    parser = argparse.ArgumentParser(prog="hf-dllm-spec", description=doc[0], epilog="examples:\n" + doc[1],
                                     formatter_class=_RAW)
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    _add_generate(sub)
    _add_job(sub, "main", main_job, "the main job: AR, dynamic and S2D2 on prompt sets, tables (bundled model)")
    _add_job(sub, "bench", sweep, "the benchmark sweep: block size x unmasking rule x S2D2 preset against AR")
    _add_job(sub, "bench-batch", batch, "benchmark: one batched call against sequential calls, tokens/s")
    _add_export(sub)
    _add_strategies(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of the `hf-dllm-spec` console script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    # The subcommand's own arguments (recorded by the benchmarks as their command line).
    rest = argv[argv.index(args.command) + 1:]
    args.handler(args, rest)


if __name__ == "__main__":
    main()
