"""Decode with a target spread over several GPUs (and CPU / disk) and a drafter placed on its own.

The target is loaded by transformers / accelerate's big-model engine, ``from_pretrained(..., device_map="auto",
max_memory=...)``: whole decoder layers fill the GPUs in order, what does not fit goes to the CPU, then to disk
(`offload_folder`). Nothing here places tensors by hand; hf_dllm_spec runs its forwards on the model's
execution device (`hf_dllm_spec.runtime.weights.execution_device`) and accelerate's hooks move the activations between
layers. A drafter (`--draft-model`, for simsd / deer) is loaded on one device of its own (`--draft-device`, and
its own `--draft-dtype`); the strategies move token ids to it and its block logits back, never a cache. See
`docs/placement.md`.

Without a GPU the script still runs the same path: `device_map="auto"` with a CPU budget of half the model
(unless `--max-memory` says otherwise), so some layers are offloaded to disk.

    python examples/multi_gpu.py                                         # bundled SDAR, s2d2
    python examples/multi_gpu.py --target JetLM/SDAR-8B-Chat --max-memory "0=10GiB,1=10GiB,cpu=64GiB"
    python examples/multi_gpu.py --target models/sdar-large --draft-model models/sdar-tiny-arith \\
        --strategy simsd --draft-dtype bfloat16
    python examples/multi_gpu.py --target models/qwen2-tiny-ar --draft-model models/deer-drafter-tiny \\
        --strategy deer
"""

from __future__ import annotations

import argparse
import pathlib
import tempfile

import torch

from hf_dllm_spec.cli_args import positive_int

ROOT = pathlib.Path(__file__).resolve().parents[1]
#: The default prompt's question (formatted with `recipes.arithmetic.format_prompt`).
DEFAULT_QUESTION = "Zoe has 14 stamps. Zoe gets 3 more stamps. How many stamps does Zoe have now?"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_max_memory(text: str | None) -> dict | None:
    """`"0=70GiB,1=70GiB,cpu=200GiB"` -> `{0: "70GiB", 1: "70GiB", "cpu": "200GiB"}` (accelerate's format).

    Raises:
        ValueError: naming `--max-memory` for an entry without "=".
    """
    from hf_dllm_spec.validation import invalid

    if not text:
        return None
    budget = {}
    for entry in text.split(","):
        device, sep, size = entry.strip().partition("=")
        if not sep or not device or not size:
            raise invalid("--max-memory", text, "be a comma-separated list of DEVICE=SIZE entries",
                          'pass e.g. "0=70GiB,1=70GiB,cpu=200GiB"')
        budget[int(device) if device.isdigit() else device] = int(size) if size.isdigit() else size
    return budget


def cpu_budget(path: str, dtype: torch.dtype) -> dict:
    """Without a GPU: a CPU budget of half the model, so accelerate puts the other half on disk."""
    from accelerate import init_empty_weights
    from accelerate.utils import compute_module_sizes
    from transformers import AutoConfig, AutoModelForCausalLM

    with init_empty_weights():
        empty = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path), dtype=dtype)
    return {"cpu": compute_module_sizes(empty)[""] // 2}


def load_target(path: str, dtype: torch.dtype, max_memory: dict | None, offload_folder: str):
    """The target through accelerate's engine: `device_map="auto"` within `max_memory`, overflow on disk."""
    from transformers import AutoModelForCausalLM

    if max_memory is None and not torch.cuda.is_available():
        max_memory = cpu_budget(path, dtype)
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, device_map="auto", max_memory=max_memory,
                                                offload_folder=offload_folder).eval()


def load_tokenizer(path: str):
    """`AutoTokenizer`, except for the bundled Qwen2-architecture models, which ship their own tokenizer.json
    (declared "TokenizersBackend"; as `hf_dllm_spec.tools.jobs.evaluation.load`)."""
    import json

    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    config = pathlib.Path(path) / "tokenizer_config.json"
    if config.is_file() and json.loads(config.read_text()).get("tokenizer_class") == "TokenizersBackend":
        return PreTrainedTokenizerFast.from_pretrained(path)
    return AutoTokenizer.from_pretrained(path)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default=str(ROOT / "models" / "sdar-tiny-arith"),
                        help="target checkpoint (local folder or Hub id)")
    parser.add_argument("--draft-model", default=None, help="drafter checkpoint, for --strategy simsd / deer")
    parser.add_argument("--strategy", default=None,
                        help="decoding_strategy (default: s2d2 without a drafter, simsd with one)")
    parser.add_argument("--max-memory", default=None,
                        help='per-device budget for the target, e.g. "0=70GiB,1=70GiB,cpu=200GiB" (default: '
                             "accelerate's; without a GPU, half the model on CPU and the rest on disk)")
    parser.add_argument("--dtype", default=None, choices=sorted(DTYPES),
                        help="the target's dtype (default: bfloat16 on GPU, float32 on CPU)")
    parser.add_argument("--draft-dtype", default=None, choices=sorted(DTYPES),
                        help="the drafter's dtype (default: the target's)")
    parser.add_argument("--draft-device", default=None,
                        help="the drafter's device (default: the last GPU, else cpu)")
    parser.add_argument("--offload-folder", default=None, help="where disk-offloaded weights go (default: a temp dir)")
    parser.add_argument("--prompt", default=None, help="prompt text (default: an arithmetic question)")
    parser.add_argument("--max-new-tokens", type=positive_int, default=32)
    return parser


def main(argv: list[str] | None = None) -> torch.Tensor:
    """Load, decode one prompt greedily, print the completion; returns the output ids `(1, P + n)`.

    Raises:
        ValueError: for a bad `--max-memory`, or from `generate` (e.g. a strategy that needs `--draft-model`).
    """
    from transformers import AutoModelForCausalLM

    import hf_dllm_spec
    from hf_dllm_spec.runtime.weights import execution_device
    from recipes.arithmetic import format_prompt

    args = build_parser().parse_args(argv)
    hf_dllm_spec.register_auto_classes()
    dtype = DTYPES[args.dtype] if args.dtype else (torch.bfloat16 if torch.cuda.is_available() else torch.float32)
    with tempfile.TemporaryDirectory() as scratch:
        target = load_target(args.target, dtype, parse_max_memory(args.max_memory), args.offload_folder or scratch)
        print(f"target: {getattr(target, 'hf_device_map', {'': str(target.device)})}, "
              f"runs on {execution_device(target)}, {target.dtype}")
        kwargs = {}
        if args.draft_model is not None:
            gpus = torch.cuda.device_count()
            device = args.draft_device or (f"cuda:{gpus - 1}" if gpus else "cpu")
            draft_dtype = DTYPES[args.draft_dtype] if args.draft_dtype else dtype
            kwargs["draft_model"] = AutoModelForCausalLM.from_pretrained(
                args.draft_model, dtype=draft_dtype, device_map={"": device}).eval()
            print(f"drafter: {device}, {draft_dtype}")
        strategy = args.strategy or ("simsd" if args.draft_model is not None else "s2d2")
        tokenizer = load_tokenizer(args.target)
        text = args.prompt if args.prompt is not None else format_prompt(DEFAULT_QUESTION)
        ids = tokenizer(text, return_tensors="pt").input_ids.to(execution_device(target))
        # `custom_generate` serves every model (a plain transformers AR target of DEER as well as SDAR).
        out = target.generate(ids, custom_generate=hf_dllm_spec.custom_generate, decoding_strategy=strategy,
                              max_new_tokens=args.max_new_tokens, do_sample=False, **kwargs)
    print(f"[{strategy}] {tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)!r}")
    return out


if __name__ == "__main__":
    try:
        main()
    except (ValueError, OSError, NotImplementedError) as error:     # a bad argument: its message, not a traceback
        build_parser().error(str(error))
