"""LLaDA2 on two GPUs: tensor parallelism (transformers' plan) against `device_map="auto"`, against one GPU.

    torchrun --standalone --nproc_per_node 2 benchmarks/llada2_tp.py \
        [--checkpoint /tmp/llada2.1-mini-random] [--layers 20] [--batch 1,8] [--max-new-tokens 128] [--repeats 3]

LLaDA2.1-mini shapes (`hf_dllm_spec.tools.cost_model.shapes.SHAPES["LLaDA2.1-mini"]`: 20 layers, hidden 2048, 16 heads /
4 K/V heads, 256 experts of 512, top-8, 1 shared expert; 16.3B parameters, about 33 GB in bf16) with seeded random
weights, built on cuda:0 by rank 0 and saved once to `--checkpoint` in the Hub layout (reused when it exists;
`--layers` shrinks the stack for a quick run). In the one torchrun job, the same checkpoint, prompts and call are
timed under three placements:

1. one GPU: rank 0 loads it on cuda:0 (rank 1 waits);
2. `device_map="auto"` on the two GPUs: rank 0 alone, `max_memory` splitting the layers evenly (accelerate runs the
   halves one after the other: it buys memory, not speed);
3. tensor parallelism: both ranks, `DistributedConfig(tp_plan="auto")` (each rank its half of every layer: head
   groups, expert slices, vocabulary; docs/placement.md).

For each batch size it prints, on rank 0, the generated tokens, forwards, seconds (median of `--repeats` calls
after one warm-up call), tokens/s, ms per forward, the ratio of tokens/s to one GPU and whether the tokens are one
GPU's (bf16: a sharded sum may round differently and flip a near tie). Random prompts (seeded),
greedy decoding with `--strategy` (default "llada2": threshold decoding with LLaDA2.1 token editing; random weights
are rarely confident, so expect about one token per forward, the same under every placement). `--static` runs the
static runtime (`cache_implementation="static"`: CUDA graphs on one device; with tensor parallelism the graphs must
capture the NCCL collectives, unmeasured so far). Without GPUs it runs on the CPU over gloo (numbers meaningless,
a check that the script runs: `--shape tiny:llada2-tiny`).

Results: none yet (no machine with two GPUs has run it; docs/placement.md).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import os
import pathlib
import statistics
import time

import torch
import torch.distributed as dist

from hf_dllm_spec.tools.cost_model.shapes import SHAPES, Shape, build_model


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="LLaDA2.1-mini",
                    help="a LLaDA2 shape of hf_dllm_spec.tools.cost_model.shapes.SHAPES")
    ap.add_argument("--layers", type=int, default=None, help="override num_hidden_layers (llada2 shapes)")
    ap.add_argument("--checkpoint", default="/tmp/llada2-tp-random", help="where the random checkpoint is kept")
    ap.add_argument("--batch", default="1,8", help="comma list of batch sizes")
    ap.add_argument("--prompt-length", type=int, default=256)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--strategy", default="llada2", help="decoding_strategy (llada2, s2d2, block_diffusion, ar)")
    ap.add_argument("--static", action="store_true", help='cache_implementation="static"')
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args(argv)


def shape_of(args) -> Shape:
    shape = SHAPES[args.shape]
    if args.layers is None:
        return shape
    if shape.family != "llada2":
        raise SystemExit(f"--layers applies to the llada2 shapes only, not {args.shape} (family {shape.family}).")
    return Shape(f"{shape.name}, {args.layers} layers", shape.family,
                 {**shape.config, "num_hidden_layers": args.layers}, shape.source)


def ensure_checkpoint(args, device: torch.device, rank: int) -> pathlib.Path:
    """Rank 0 builds and saves the random-weight model once (Hub layout); every rank waits for it."""
    path = pathlib.Path(args.checkpoint)
    if rank == 0 and not (path / "config.json").exists():
        model = build_model(shape_of(args), device, torch.bfloat16, "none", args.seed)
        model.save_pretrained(path)
        print(f"saved {sum(p.numel() for p in model.parameters()) / 1e9:.2f}B random parameters to {path}",
              flush=True)
        del model
        release(device)
    dist.barrier()
    return path


def release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def timed(model, ids: torch.Tensor, args, device: torch.device) -> dict:
    """Median over `--repeats` calls (one warm-up call first) of one greedy `generate` on `ids` `(N, P)`."""
    kwargs = dict(decoding_strategy=args.strategy, max_new_tokens=args.max_new_tokens, do_sample=False,
                  return_dict_in_generate=True, **({"cache_implementation": "static"} if args.static else {}))
    model.generate(ids, **kwargs)
    runs = []
    for _ in range(args.repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        out = model.generate(ids, **kwargs)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        runs.append((time.perf_counter() - start, out.spec_stats, out.sequences.tolist()))
    seconds = statistics.median(s for s, _, _ in runs)
    stats = runs[0][1]
    return {"seconds": seconds, "tokens": stats.num_generated_tokens, "forwards": stats.num_forward_calls,
            "sequences": runs[0][2]}


def prompts(args, batch: int, vocab_size: int, device: torch.device) -> torch.Tensor:
    gen = torch.Generator().manual_seed(args.seed + batch)
    return torch.randint(0, min(vocab_size, 150000), (batch, args.prompt_length), generator=gen).to(device)


def main(argv=None) -> None:
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    import hf_dllm_spec

    args = parse_args(argv)
    hf_dllm_spec.register_auto_classes()
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    # Rank 1 waits while rank 0 builds the checkpoint and runs placements 1 and 2: a long timeout.
    dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(hours=3))
    if world != 2 or (cuda and torch.cuda.device_count() < 2):
        raise SystemExit("run with `torchrun --standalone --nproc_per_node 2` on a machine with 2 GPUs (or none).")
    first = torch.device("cuda", 0) if cuda else torch.device("cpu")
    here = torch.device("cuda", rank) if cuda else torch.device("cpu")
    path = ensure_checkpoint(args, first, rank)
    batches = [int(b) for b in args.batch.split(",")]
    rows: dict[str, dict[int, dict]] = {}

    # 1 and 2: rank 0 alone (one GPU, then accelerate's layer split over both); rank 1 waits.
    if rank == 0:
        placements = {"1 GPU": dict(device_map={"": first})}
        if cuda:
            size = sum(f.stat().st_size for f in path.glob("*.safetensors"))
            half = f"{int(size * 0.55 / 2 ** 30) + 4}GiB"        # half the weights, plus room for K/V, activations
            placements['device_map="auto", 2 GPUs'] = dict(device_map="auto", max_memory={0: half, 1: half})
        for label, placement in placements.items():
            model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, **placement).eval()
            rows[label] = {b: timed(model, prompts(args, b, model.config.vocab_size, first), args, first)
                           for b in batches}
            del model
            release(first)
    dist.barrier()

    # 3: tensor parallelism over both ranks.
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16,
                                                 distributed_config=DistributedConfig(tp_plan="auto")).eval()
    rows["tp_plan, 2 GPUs"] = {b: timed(model, prompts(args, b, model.config.vocab_size, here), args, here)
                               for b in batches}
    if rank == 0:
        device = torch.cuda.get_device_name(0) if cuda else "cpu"
        print(f"\n{shape_of(args).name}, bf16, {args.strategy}{' static' if args.static else ''}, prompt "
              f"{args.prompt_length}, {args.max_new_tokens} new tokens, device {device}")
        print("| placement | batch | tokens | forwards | s | tokens/s | ms / forward | tokens/s vs 1 GPU "
              "| same tokens |")
        print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
        for label, by_batch in rows.items():
            for b, r in by_batch.items():
                base = rows["1 GPU"][b]
                ratio = (r["tokens"] / r["seconds"]) / (base["tokens"] / base["seconds"])
                print(f"| {label} | {b} | {r['tokens']} | {r['forwards']} | {r['seconds']:.2f} | "
                      f"{r['tokens'] / r['seconds']:.1f} | {1000 * r['seconds'] / max(r['forwards'], 1):.1f} | "
                      f"{ratio:.2f} | {'yes' if r['sequences'] == base['sequences'] else 'no'} |")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
