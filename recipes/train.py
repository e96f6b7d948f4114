"""The one training recipe of the bundled models: offline data, pluggable objectives, resumable stages.

    python -m recipes.train --objective block_diffusion --out models/sdar-tiny-arith ...   (SDAR)
    python -m recipes.train --objective ar --out models/qwen2-tiny-ar ...                   (AR Qwen2)
    python -m recipes.train --objective fast_dllm_v2 --init-from models/qwen2-tiny-ar \\
        --out models/fast-dllm-v2-tiny ...                                                 (Fast-dLLM v2)
    python -m recipes.train --objective llada2 --init-from models/sdar-tiny-arith \\
        --out models/llada2-tiny ...                                                       (LLaDA2 MoE, editing)

Each model card (`models/*/README.md`) lists the exact commands of its stages. Objectives live in
`recipes.objectives`. Steps: (1) a byte-level BPE tokenizer (8,192 tokens, digits split one by one) trained with
`tokenizers` on the CPython standard library and arithmetic problems, or the tokenizer of `--init-from`;
(2) token streams: stdlib sources (every token a target) and templated arithmetic problems (question tokens
are context only: never masked, never a loss target); (3) the objective's loss, AdamW (betas 0.9/0.95, weight
decay 0.1), transformers' cosine schedule with 2% warm-up, gradient clipping 1.0, bf16 autocast on CPU;
(4) the objective saves the model in its family's Hub layout with the tokenizer and the held-out problems, and
the stage is appended to `training_log.json` (stages chain with `--init-from`).

Resumable: with `--checkpoint-minutes M` the loop writes `<out>/resume.pt` (model, optimiser, schedule, step,
generator state, loss history) every M minutes, atomically; a stage stopped by `--max-minutes` saves its model so
far and keeps a current `resume.pt`. `--resume` continues from it with the same arguments and gives the same
result as an uninterrupted run. Every argument, the family of `--init-from` / `--teacher` (their `config.json`)
included, is checked before any data loads (exit status 2 with the rule and the fix).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import random
import time

import torch
from tqdm import tqdm

from .arithmetic import format_prompt, generate_problems, heldout_problems, heldout_questions
from .data import stdlib_texts
from .growth import grow_depth
from .objectives import EOS_ID, MASK_ID, OBJECTIVES, PAD_ID, SPECIALS, read_stages


def train_tokenizer(texts: list[str], vocab_size: int):
    """Byte-level BPE with individual digits; returns a `PreTrainedTokenizerFast`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS, min_frequency=2,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=True)
    tok.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=SPECIALS[0], pad_token=SPECIALS[1],
                                   mask_token=SPECIALS[2])


def build_streams(tokenizer, code_texts: list[str], problems: list[dict]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Concatenated token streams with a parallel `maskable` flag (loss target), one per source."""
    code_ids = tokenizer(code_texts, add_special_tokens=False)["input_ids"]
    code = torch.tensor([t for ids in code_ids for t in ids + [EOS_ID]], dtype=torch.long)
    prompts = tokenizer([format_prompt(p["question"]) for p in problems], add_special_tokens=False)["input_ids"]
    answers = tokenizer([" " + p["solution"] for p in problems], add_special_tokens=False)["input_ids"]
    ids, maskable = [], []
    for q, a in zip(prompts, answers):
        ids += q + a + [EOS_ID]
        maskable += [False] * len(q) + [True] * (len(a) + 1)
    arith = torch.tensor(ids, dtype=torch.long)
    return {"code": (code, torch.ones_like(code, dtype=torch.bool)),
            "arith": (arith, torch.tensor(maskable, dtype=torch.bool))}


def sample_batch(streams, batch_size: int, seq_len: int, arith_fraction: float, gen: torch.Generator):
    """`(batch, seq_len)` windows at random offsets of the streams (any of a stream's `N - seq_len + 1` windows,
    the one ending on its last token included), and their `maskable` flags."""
    rows, flags = [], []
    for _ in range(batch_size):
        name = "arith" if torch.rand((), generator=gen) < arith_fraction else "code"
        ids, maskable = streams[name]
        start = int(torch.randint(0, ids.shape[0] - seq_len + 1, (), generator=gen))
        rows.append(ids[start:start + seq_len])
        flags.append(maskable[start:start + seq_len])
    return torch.stack(rows), torch.stack(flags)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--objective", required=True, choices=sorted(OBJECTIVES))
    ap.add_argument("--out", required=True)
    ap.add_argument("--tokens", type=int, default=10_000_000, help="training tokens (sequence positions)")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--arith-fraction", type=float, default=0.6)
    ap.add_argument("--train-problems", type=int, default=120_000)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--vocab-size", type=int, default=8192)
    ap.add_argument("--bd-size", type=int, default=32, help="fast_dllm_v2: block size of the conversion")
    ap.add_argument("--teacher", default=None, help="d2a: the AR teacher (same tokenizer)")
    ap.add_argument("--d2a-stage", type=int, default=1, choices=(1, 2), help="d2a: Stage I or Stage II")
    ap.add_argument("--d2a-alpha", type=float, default=1.01, help="d2a Stage II: weight base alpha")
    ap.add_argument("--d2a-max-refine", type=int, default=96, help="d2a Stage II: R ~ U(1, this)")
    ap.add_argument("--d2a-teacher-problems", type=int, default=8000, help="d2a: problems the teacher answers")
    ap.add_argument("--d2a-teacher-code", type=int, default=2000, help="d2a: code windows the teacher continues")
    ap.add_argument("--d2a-teacher-cache", default=None, help="d2a: file keeping the teacher's continuations "
                    "between stages (written when missing; same teacher, seed and counts)")
    ap.add_argument("--d2a-sep-token-id", type=int, default=None, help="d2a: SEP token (not supported yet)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-operand", type=int, default=50, help="arithmetic difficulty (recipes.arithmetic)")
    ap.add_argument("--init-from", default=None, help="continue from this checkpoint (and reuse its tokenizer)")
    ap.add_argument("--grow-layers", type=int, default=None,
                    help="with --init-from: grow to this many layers by block expansion (recipes.growth)")
    ap.add_argument("--tokenizer-from", default=None, help="reuse this checkpoint's tokenizer (new model)")
    ap.add_argument("--max-minutes", type=float, default=None, help="stop early after this wall time")
    ap.add_argument("--checkpoint-minutes", type=float, default=None, help="write <out>/resume.pt this often")
    ap.add_argument("--resume", action="store_true", help="continue from <out>/resume.pt")
    args = ap.parse_args(argv)
    problem = check_args(args)
    if problem:
        ap.error(problem)
    args.error = ap.error
    return args


def check_args(args: argparse.Namespace) -> str | None:
    """The first rule `args` break, as "FLAG (=value) must ...: fix", before any data loads; None if they hold."""
    for flag in ("tokens", "seq_len", "batch_size", "train_problems", "layers", "hidden", "vocab_size", "bd_size"):
        value = getattr(args, flag)
        if value < 1:
            return f"--{flag.replace('_', '-')} (={value}) must be >= 1"
    if args.max_operand < 3:
        return (f"--max-operand (={args.max_operand}) must be >= 3 (the problems draw operands from 2 up to it, and "
                "from 2 up to 0.6 times it): pass e.g. --max-operand 20")
    if not (math.isfinite(args.lr) and args.lr > 0):
        return f"--lr (={args.lr}) must be a number > 0: pass e.g. 1e-3"
    if not 0 <= args.arith_fraction <= 1:
        return f"--arith-fraction (={args.arith_fraction}) must lie in [0, 1] (the share of arithmetic windows)"
    for flag in ("max_minutes", "checkpoint_minutes"):
        value = getattr(args, flag)
        if value is not None and not value > 0:
            return f"--{flag.replace('_', '-')} (={value}) must be > 0 minutes"
    if args.objective == "fast_dllm_v2" and args.seq_len % args.bd_size:
        return (f"--seq-len (={args.seq_len}) must be a multiple of --bd-size (={args.bd_size}) for --objective "
                f"fast_dllm_v2 (one masking rate per block of the window): pass e.g. --seq-len "
                f"{max(1, args.seq_len // args.bd_size) * args.bd_size}")
    objective = OBJECTIVES[args.objective]
    if objective.init_required and not args.init_from:
        types = " or ".join(objective.init_types)
        return (f"--init-from is required for --objective {args.objective} (it starts from a trained checkpoint): "
                f"pass a {types} checkpoint directory, e.g. --init-from models/"
                f"{'qwen2-tiny-ar' if 'qwen2' in types else 'sdar-tiny-arith'}")
    for flag, path, types in (("--init-from", args.init_from, objective.init_types),
                              ("--teacher", getattr(args, "teacher", None), objective.teacher_types)):
        problem = check_checkpoint(flag, path, types, args.objective)
        if problem:
            return problem
    if args.tokenizer_from and not (pathlib.Path(args.tokenizer_from) / "tokenizer.json").is_file():
        return (f"--tokenizer-from (={args.tokenizer_from}) must be a directory with a tokenizer.json (what "
                "save_pretrained writes for a fast tokenizer), e.g. --tokenizer-from models/sdar-tiny-arith")
    if args.init_from and args.tokenizer_from:
        return ("--tokenizer-from must be left out with --init-from (the model's own tokenizer is reused): pass one "
                "of them")
    if args.grow_layers is not None:
        if not args.init_from:
            return "--grow-layers needs --init-from (the trained model to grow): pass both"
        if args.objective == "llada2":
            return ("--grow-layers grows dense decoders (recipes.growth), not LLaDA2's MoE: grow the SDAR checkpoint "
                    "first (--objective block_diffusion --grow-layers N), then upcycle it with --objective llada2")
        layers = _config(args.init_from).get("num_hidden_layers", 1)
        if args.grow_layers <= layers or args.grow_layers % layers:
            return (f"--grow-layers (={args.grow_layers}) must be a multiple of the --init-from model's {layers} "
                    f"layers, larger than it: pass e.g. --grow-layers {2 * layers}")
    try:
        objective(args)                          # an objective refuses its own settings when it is built
    except (ValueError, NotImplementedError) as err:
        return str(err)
    if args.resume and not (pathlib.Path(args.out) / "resume.pt").exists():
        return (f"--resume needs {pathlib.Path(args.out) / 'resume.pt'} (written with --checkpoint-minutes): run "
                "without --resume, or pass the --out of the interrupted run")
    return None


def _config(path: str) -> dict:
    return json.loads((pathlib.Path(path) / "config.json").read_text(encoding="utf-8"))


def check_checkpoint(flag: str, path: str | None, types: tuple[str, ...], objective: str) -> str | None:
    """The rule a checkpoint flag breaks ("FLAG (=path) must ..."), before anything loads: a local directory with a
    `config.json` whose `model_type` is one of `types` (any when empty); None when it holds or `path` is None.
    (A starting model of another family was loaded anyway: transformers built a mostly random model and the run
    trained it.)"""
    if path is None:
        return None
    if not (pathlib.Path(path) / "config.json").is_file():
        return f"{flag} (={path}) must be a checkpoint directory with a config.json (the recipe runs offline)"
    try:
        model_type = _config(path).get("model_type")
    except (ValueError, UnicodeDecodeError) as err:
        return f"{flag} (={path}) must hold a readable config.json ({type(err).__name__}: {err})"
    if types and model_type not in types:
        return (f"{flag} (={path}) must be a checkpoint of model_type {' or '.join(map(repr, types))} for "
                f"--objective {objective} (it is {model_type!r}): pass such a checkpoint")
    return None


def check_streams(streams: dict, seq_len: int, arith_fraction: float) -> None:
    """Refuse a window longer than a stream it samples from (`sample_batch` draws from a stream's windows).

    Raises:
        ValueError: naming `--seq-len`, the stream and its length.
    """
    used = [name for name, share in (("arith", arith_fraction), ("code", 1 - arith_fraction)) if share > 0]
    for name in used:
        length = int(streams[name][0].shape[0])
        if length < seq_len:
            raise ValueError(f"--seq-len (={seq_len}) must be at most the {name} stream's {length} tokens: pass a "
                             "shorter --seq-len, or more data (--train-problems)")


def save_resume(path: pathlib.Path, checkpoint: dict) -> None:
    """Write the resume point atomically: to a temporary file beside it, then renamed over it (a run killed while
    writing keeps the previous one; written in place, it left a truncated archive that `--resume` could not read)."""
    partial = path.with_name(path.name + ".partial")
    torch.save(checkpoint, partial)
    os.replace(partial, path)


def load_tokenizer(args, code: list[str], problems: list[dict]):
    source = args.init_from or args.tokenizer_from
    if source:
        # Not AutoTokenizer: for `model_type: "qwen2"` it builds transformers' Qwen2Tokenizer, which replaces the
        # tokenizer.json pre-tokenizer with Qwen2's and tokenizes differently from the model's own tokenizer.
        from transformers import PreTrainedTokenizerFast

        tokenizer = PreTrainedTokenizerFast.from_pretrained(source)
    else:
        tok_texts = code + [format_prompt(p["question"]) + " " + p["solution"] for p in problems[:20_000]]
        tokenizer = train_tokenizer(tok_texts, args.vocab_size)
    if tokenizer.convert_tokens_to_ids(SPECIALS) != [EOS_ID, PAD_ID, MASK_ID]:
        flag = "--init-from" if args.init_from else "--tokenizer-from"
        raise ValueError(f"{flag} (={source}) must have a tokenizer whose special tokens {SPECIALS} are the ids "
                         f"[{EOS_ID}, {PAD_ID}, {MASK_ID}] (they are {tokenizer.convert_tokens_to_ids(SPECIALS)}): "
                         "pass a checkpoint of this recipe, or neither flag to train a tokenizer")
    return tokenizer


def main(argv: list[str] | None = None) -> None:
    from transformers import get_scheduler

    args = parse_args(argv)
    objective = OBJECTIVES[args.objective](args)
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    heldout = heldout_problems(max_operand=args.max_operand)
    problems = generate_problems(args.train_problems, seed=args.seed + 1, exclude=heldout_questions(args.max_operand),
                                 max_operand=args.max_operand)
    code = stdlib_texts()
    print(f"data: {len(code)} stdlib files, {len(problems)} arithmetic problems, {len(heldout)} held out")
    try:            # the rules only the data can tell (a tokenizer's ids, a stream's length, a teacher cache)
        tokenizer = objective.prepare_tokenizer(load_tokenizer(args, code, problems))
        streams = objective.build_streams(tokenizer, code, problems, build_streams)
        print({k: int(v[0].shape[0]) for k, v in streams.items()}, "tokens per stream")
        check_streams(streams, args.seq_len, args.arith_fraction)
    except ValueError as err:
        args.error(str(err))

    previous_stages = read_stages(args.init_from)
    model = objective.build_model(args, tokenizer, args.init_from)
    if args.grow_layers is not None:                # with --init-from, not llada2 (check_args)
        model = grow_depth(model, args.grow_layers)
    model.train()
    num_params = sum(p.numel() for p in model.parameters())
    print(f"model: {num_params / 1e6:.2f}M parameters ({args.objective})")
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    tokens_per_step = args.batch_size * args.seq_len
    total_steps = max(1, args.tokens // tokens_per_step)
    scheduler = get_scheduler("cosine", opt, num_warmup_steps=max(1, total_steps // 50), num_training_steps=total_steps)
    gen = torch.Generator().manual_seed(args.seed)
    state = {"step": 0, "ema": None, "history": [], "seconds": 0.0}
    resume_path = out / "resume.pt"
    if args.resume:
        saved = torch.load(resume_path, weights_only=False)
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["optimizer"])
        scheduler.load_state_dict(saved["scheduler"])
        gen.set_state(saved["generator"])
        state = saved["state"]
        print(f"resumed at step {state['step']} of {total_steps}")
    t0 = time.time() - state["seconds"]                  # the stage's training time, resumed runs included
    last_checkpoint = run_start = time.time()             # --max-minutes counts this run's own time
    bar = tqdm(range(state["step"], total_steps), desc=f"train {args.objective}", mininterval=10)
    for step in bar:
        x, maskable = sample_batch(streams, args.batch_size, args.seq_len, args.arith_fraction, gen)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = objective.loss(model, x, maskable, gen)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        scheduler.step()
        value = loss.item()
        state["ema"] = value if state["ema"] is None else 0.98 * state["ema"] + 0.02 * value
        state["step"] = step + 1
        if step % 50 == 0 or step == total_steps - 1:
            state["history"].append({"step": step, "tokens": (step + 1) * tokens_per_step,
                                     "loss_ema": round(state["ema"], 4)})
            bar.set_postfix(loss=f"{state['ema']:.3f}", lr=f"{scheduler.get_last_lr()[0]:.1e}")
        now = time.time()
        stop = args.max_minutes is not None and now - run_start > 60 * args.max_minutes and state["step"] < total_steps
        if stop or (args.checkpoint_minutes is not None and now - last_checkpoint > 60 * args.checkpoint_minutes):
            state["seconds"] = now - t0
            save_resume(resume_path, {"model": model.state_dict(), "optimizer": opt.state_dict(),
                                      "scheduler": scheduler.state_dict(), "generator": gen.get_state(),
                                      "state": state})
            last_checkpoint = time.time()
        if stop:
            print(f"stopping at step {state['step']} of {total_steps}: --max-minutes {args.max_minutes} reached; the "
                  f"model so far is saved, and the same command with --resume continues from {resume_path}")
            break
    elapsed = time.time() - t0
    objective.save(model, tokenizer, out)
    with open(out / "heldout_arithmetic.jsonl", "w") as f:
        for p in heldout:
            f.write(json.dumps(p) + "\n")
    stage = {
        "objective": args.objective, "init_from": args.init_from, "grow_layers": args.grow_layers,
        "max_operand": args.max_operand,
        "seed": args.seed, "steps": state["step"], "tokens_seen": state["step"] * tokens_per_step,
        "seq_len": args.seq_len, "batch_size": args.batch_size, "lr": args.lr, "arith_fraction": args.arith_fraction,
        **objective.record(), "parameters": num_params, "train_seconds": round(elapsed, 1),
        "final_loss_ema": round(state["ema"], 4), "stream_tokens": {k: int(v[0].shape[0]) for k, v in streams.items()},
        "loss_history": state["history"], "torch": torch.__version__,
    }
    stages = [*previous_stages, stage]
    summary = {"stages": stages, "tokens_seen_total": sum(s["tokens_seen"] for s in stages),
               "train_seconds_total": round(sum(s["train_seconds"] for s in stages), 1)}
    (out / "training_log.json").write_text(json.dumps(summary, indent=1))
    if state["step"] >= total_steps:                # a stage stopped by --max-minutes keeps its resume point
        resume_path.unlink(missing_ok=True)
    print(json.dumps({k: v for k, v in stage.items() if k != "loss_history"}))


if __name__ == "__main__":
    main()
