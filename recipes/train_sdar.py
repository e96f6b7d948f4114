"""Train the bundled SDAR-style block-diffusion model from scratch, offline, reproducibly from a seed.

    python -m recipes.train_sdar --out /tmp/stage1 --tokens 6000000 --max-operand 50
    python -m recipes.train_sdar --out /tmp/stage2 --init-from /tmp/stage1 --tokens 6000000 \
        --max-operand 20 --arith-fraction 0.75 --lr 1e-3 --seed 1
    python -m recipes.train_sdar --out models/sdar-tiny-arith --init-from /tmp/stage2 --tokens 3600000 \
        --max-operand 20 --arith-fraction 0.7 --lr 6e-4 --seed 2

(the three stages of the bundled checkpoint, about 1 h 45 min on 2 CPU cores; `--init-from` continues from a
saved checkpoint and reuses its tokenizer; each stage appends itself to `training_log.json`)

Steps: (1) a byte-level BPE tokenizer (8,192 tokens, digits split one by one) trained with `tokenizers` on
the CPython standard library and arithmetic problems; (2) token streams: stdlib sources (all tokens
maskable) and templated arithmetic problems (question tokens never masked, as SDAR never masks the prompt);
(3) SDAR training (SDAR, arXiv 2510.06303, block-diffusion objective): input `[noisy copy | clean copy]` with shared position ids and the
block-diffusion mask (noisy block sees itself and strictly earlier clean blocks; clean is block-causal);
one t ~ U(1e-3, 1) per sequence; cross-entropy on the masked positions of the noisy half weighted by 1/t and
normalised by the number of maskable tokens. The block size is drawn per step (4 most of the time, the
trained block size written to the config; also 1 and 16 so that the AR mode S2D2 verifies with and larger
blocks stay usable; recorded in the model card). (4) Save in the SDAR Hub layout (bf16 safetensors,
`model_type: "sdar"`, `block_size`, `mask_token_id`, generation_config eos list) plus the tokenizer and the
held-out problems.
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import random
import time

import torch
from tqdm import tqdm

from .arithmetic import format_prompt, generate_problems, heldout_problems
from .data import stdlib_texts

SPECIALS = ["<|endoftext|>", "<|pad|>", "<|mask|>"]
EOS_ID, PAD_ID, MASK_ID = 0, 1, 2
BLOCK_SIZE_MIX = {4: 0.6, 1: 0.2, 16: 0.2}


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
    """Concatenated token streams with a parallel `maskable` flag, one per source."""
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


def bd_training_mask(seq_len: int, block_size: int) -> torch.Tensor:
    """SDAR training mask over `[noisy | clean]`, `(2L, 2L)` bool (the SDAR training mask)."""
    blk = torch.arange(seq_len) // block_size
    same = blk[:, None] == blk[None, :]
    earlier = blk[None, :] < blk[:, None]
    causal_blocks = blk[None, :] <= blk[:, None]
    top = torch.cat([same, earlier], dim=1)                       # noisy rows
    bottom = torch.cat([torch.zeros_like(same), causal_blocks], dim=1)  # clean rows
    return torch.cat([top, bottom], dim=0)


def sample_batch(streams, batch_size: int, seq_len: int, arith_fraction: float, gen: torch.Generator):
    rows, flags = [], []
    for _ in range(batch_size):
        name = "arith" if torch.rand((), generator=gen) < arith_fraction else "code"
        ids, maskable = streams[name]
        start = int(torch.randint(0, ids.shape[0] - seq_len, (), generator=gen))
        rows.append(ids[start:start + seq_len])
        flags.append(maskable[start:start + seq_len])
    return torch.stack(rows), torch.stack(flags)


def diffusion_loss(model, x: torch.Tensor, maskable: torch.Tensor, block_size: int, gen: torch.Generator,
                   mask_cache: dict) -> torch.Tensor:
    """SDAR masked-token loss for one batch `(b, L)`."""
    b, seq_len = x.shape
    t = torch.rand(b, generator=gen) * (1 - 1e-3) + 1e-3                         # (b,)
    noise = (torch.rand(b, seq_len, generator=gen) < t[:, None]) & maskable       # (b, L)
    noisy = torch.where(noise, torch.full_like(x, MASK_ID), x)
    if block_size not in mask_cache:
        mask_cache[block_size] = bd_training_mask(seq_len, block_size)[None, None]
    pos = torch.arange(seq_len).repeat(2)[None].expand(b, -1)
    hidden = model.model(input_ids=torch.cat([noisy, x], dim=1), position_ids=pos,
                         attention_mask=mask_cache[block_size].expand(b, -1, -1, -1)).last_hidden_state
    h = hidden[:, :seq_len][noise]                                                 # (N, H)
    logits = model.lm_head(h).float()                                              # (N, V)
    token_loss = torch.nn.functional.cross_entropy(logits, x[noise], reduction="none")
    weights = (1.0 / t)[:, None].expand(b, seq_len)[noise]
    return (token_loss * weights).sum() / maskable.sum().clamp_min(1)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="models/sdar-tiny-arith")
    ap.add_argument("--tokens", type=int, default=10_000_000, help="training tokens (sequence positions)")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--arith-fraction", type=float, default=0.6)
    ap.add_argument("--train-problems", type=int, default=120_000)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--vocab-size", type=int, default=8192)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-operand", type=int, default=50, help="arithmetic difficulty (recipes.arithmetic)")
    ap.add_argument("--init-from", default=None, help="continue from this checkpoint (and reuse its tokenizer)")
    ap.add_argument("--compile", action="store_true", help="torch.compile the model (about 1 min to compile)")
    ap.add_argument("--max-minutes", type=float, default=None, help="stop early after this wall time")
    args = ap.parse_args(argv)

    from model_patches.sdar import SDARConfig, SDARForCausalLM

    torch.manual_seed(args.seed)
    random.seed(args.seed)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    heldout = heldout_problems(max_operand=args.max_operand)
    exclude = {p["question"] for p in heldout}
    problems = generate_problems(args.train_problems, seed=args.seed + 1, exclude=exclude,
                                 max_operand=args.max_operand)
    code = stdlib_texts()
    print(f"data: {len(code)} stdlib files, {len(problems)} arithmetic problems, {len(heldout)} held out")
    previous_stages: list = []
    if args.init_from:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.init_from)
        log = pathlib.Path(args.init_from) / "training_log.json"
        if log.exists():
            previous = json.loads(log.read_text())
            previous_stages = previous.get("stages", [previous])
    else:
        tok_texts = code + [format_prompt(p["question"]) + " " + p["solution"] for p in problems[:20_000]]
        tokenizer = train_tokenizer(tok_texts, args.vocab_size)
    if tokenizer.convert_tokens_to_ids(SPECIALS) != [EOS_ID, PAD_ID, MASK_ID]:
        raise ValueError(f"tokenizer special ids {tokenizer.convert_tokens_to_ids(SPECIALS)} != [0, 1, 2]")
    streams = build_streams(tokenizer, code, problems)
    print({k: int(v[0].shape[0]) for k, v in streams.items()}, "tokens per stream")

    config = SDARConfig(
        vocab_size=len(tokenizer), hidden_size=args.hidden, intermediate_size=3 * args.hidden,
        num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2, head_dim=args.hidden // 4,
        max_position_embeddings=2048, rope_theta=10_000.0, tie_word_embeddings=True, block_size=4,
        mask_token_id=MASK_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID, bos_token_id=None,
        attn_implementation="sdpa",
    )
    if args.init_from:
        model = SDARForCausalLM.from_pretrained(args.init_from, dtype=torch.float32, attn_implementation="sdpa")
    else:
        model = SDARForCausalLM(config)
    model.train()
    num_params = sum(p.numel() for p in model.parameters())
    print(f"model: {num_params / 1e6:.2f}M parameters")
    step_fn = torch.compile(diffusion_loss) if args.compile else diffusion_loss
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    tokens_per_step = args.batch_size * args.seq_len
    total_steps = max(1, args.tokens // tokens_per_step)
    warmup = max(1, total_steps // 50)
    gen = torch.Generator().manual_seed(args.seed)
    sizes, size_weights = list(BLOCK_SIZE_MIX), torch.tensor(list(BLOCK_SIZE_MIX.values()))
    mask_cache: dict = {}
    t0, ema, history = time.time(), None, []
    bar = tqdm(range(total_steps), desc="train", mininterval=10)
    for step in bar:
        lr = args.lr * min(1.0, (step + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * step / total_steps))
        for group in opt.param_groups:
            group["lr"] = lr
        block_size = sizes[int(torch.multinomial(size_weights, 1, generator=gen))]
        x, maskable = sample_batch(streams, args.batch_size, args.seq_len, args.arith_fraction, gen)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = step_fn(model, x, maskable, block_size, gen, mask_cache)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        ema = loss.item() if ema is None else 0.98 * ema + 0.02 * loss.item()
        if step % 50 == 0 or step == total_steps - 1:
            history.append({"step": step, "tokens": (step + 1) * tokens_per_step, "loss_ema": round(ema, 4)})
            bar.set_postfix(loss=f"{ema:.3f}", lr=f"{lr:.1e}")
        if args.max_minutes is not None and time.time() - t0 > 60 * args.max_minutes:
            print(f"stopping at step {step}: --max-minutes {args.max_minutes} reached")
            break
    elapsed = time.time() - t0
    steps_done = step + 1
    model.eval()
    model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    model.generation_config.eos_token_id = [EOS_ID]
    model.generation_config.pad_token_id = PAD_ID
    model.generation_config.save_pretrained(out)
    with open(out / "heldout_arithmetic.jsonl", "w") as f:
        for p in heldout:
            f.write(json.dumps(p) + "\n")
    stage = {
        "init_from": args.init_from, "max_operand": args.max_operand, "seed": args.seed, "steps": steps_done, "tokens_seen": steps_done * tokens_per_step,
        "seq_len": args.seq_len, "batch_size": args.batch_size, "lr": args.lr, "arith_fraction": args.arith_fraction,
        "block_size_mix": BLOCK_SIZE_MIX, "parameters": num_params, "train_seconds": round(elapsed, 1),
        "final_loss_ema": round(ema, 4), "stream_tokens": {k: int(v[0].shape[0]) for k, v in streams.items()},
        "loss_history": history, "torch": torch.__version__,
    }
    stages = [*previous_stages, stage]
    summary = {"stages": stages, "tokens_seen_total": sum(s["tokens_seen"] for s in stages),
               "train_seconds_total": round(sum(s["train_seconds"] for s in stages), 1)}
    (out / "training_log.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps({k: v for k, v in stage.items() if k != "loss_history"}))


if __name__ == "__main__":
    main()
