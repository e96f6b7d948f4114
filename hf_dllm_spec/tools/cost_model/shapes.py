"""The model shapes the cost model times: real-scale configs and the bundled ones, built with random weights.

`SHAPES` holds the configs (written from `shared/reference/families.md`; no download), `SCALES` maps each
`--shape` and group of the COUNT phase to its target and drafter shapes, and `build_model` builds one with seeded
random weights, optionally quantized through bitsandbytes as real checkpoints load.
"""

from __future__ import annotations

import gc
import importlib
import importlib.util
import logging
import pathlib
import tempfile
from dataclasses import dataclass

import torch

from hf_dllm_spec.tools.jobs.evaluation import ROOT

MODELS_DIR = ROOT / "models"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
QUANTS = ("none", "8bit", "nf4")
#: bytes per parameter by storage, for the memory check before building a shape (nf4: 4-bit codes + absmax,
#: metrics.md §6; 8-bit: int8 + scales).
BYTES_PER_PARAM = {"float32": 4.0, "bfloat16": 2.0, "float16": 2.0, "8bit": 1.05, "nf4": 0.56}


@dataclass(frozen=True)
class Shape:
    """A model shape to time: the config class (by family) and its keyword arguments.

    Attributes:
        name (`str`): e.g. "SDAR-1.7B".
        family (`str`): "sdar" (Qwen3 layout, SDAR classes), "qwen3" (transformers' Qwen3 AR model), "qwen2"
            (transformers' Qwen2 AR model: the stock twins of `baseline`), "fast_dllm_v2" (Qwen2 layout),
            "llada2" (LLaDA2 MoE), or "bundled" (the config.json of `models/<dir>`).
        config (`dict`): config keywords (for "bundled": {"dir": name}).
        source (`str`): where the numbers come from.
    """

    name: str
    family: str
    config: dict
    source: str


_QWEN3_COMMON = dict(vocab_size=151936, head_dim=128, rope_theta=1e6, rms_norm_eps=1e-6, attention_bias=False,
                     max_position_embeddings=32768)
SHAPES: dict[str, Shape] = {
    "SDAR-1.7B": Shape("SDAR-1.7B", "sdar", dict(_QWEN3_COMMON, hidden_size=2048, intermediate_size=6144,
                                                 num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                                                 tie_word_embeddings=True, block_size=4, mask_token_id=151669),
                       "families.md §2.1 (Qwen3-1.7B layout; marked open there)"),
    "SDAR-8B": Shape("SDAR-8B", "sdar", dict(_QWEN3_COMMON, hidden_size=4096, intermediate_size=12288,
                                             num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                                             tie_word_embeddings=False, block_size=4, mask_token_id=151669),
                     "families.md §2.1 (SDAR-8B-Chat config)"),
    "Qwen3-8B": Shape("Qwen3-8B", "qwen3", dict(_QWEN3_COMMON, hidden_size=4096, intermediate_size=12288,
                                                num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                                                tie_word_embeddings=False, max_position_embeddings=40960),
                      "families.md §5 (Qwen3-8B)"),
    # DEER's drafter: Open-dCoder 0.5B has Qwen2.5-0.5B dimensions (families.md §6); built as an SDAR (Qwen3
    # layout: q/k norm, no qkv bias) diffusion model, the class the library's DEER drafter runs as here.
    "Open-dCoder-0.5B": Shape("Open-dCoder-0.5B", "sdar", dict(_QWEN3_COMMON, hidden_size=896, intermediate_size=4864,
                                                               num_hidden_layers=24, num_attention_heads=14,
                                                               num_key_value_heads=2, head_dim=64,
                                                               tie_word_embeddings=True, block_size=4,
                                                               mask_token_id=151669),
                              "families.md §5-6 (Qwen2.5-0.5B dimensions, Qwen3 layout)"),
    "Fast-dLLM-v2-1.5B": Shape("Fast-dLLM-v2-1.5B", "fast_dllm_v2",
                               dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                                    num_attention_heads=12, num_key_value_heads=2, rope_theta=1e6, rms_norm_eps=1e-6,
                                    max_position_embeddings=32768, tie_word_embeddings=True, bd_size=32,
                                    mask_token_id=151665),
                               "families.md §3.1 (Qwen2.5-1.5B base values)"),
    "Fast-dLLM-v2-7B": Shape("Fast-dLLM-v2-7B", "fast_dllm_v2",
                             dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                                  num_attention_heads=28, num_key_value_heads=4, rope_theta=1e6, rms_norm_eps=1e-6,
                                  max_position_embeddings=32768, tie_word_embeddings=False, bd_size=32,
                                  mask_token_id=151665),
                             "families.md §3.1 (7B)"),
    "LLaDA2.1-mini": Shape("LLaDA2.1-mini", "llada2", dict(mask_token_id=156895, block_size=32),
                           "families.md §4.1 (mini; the LLaDA2MoeConfig defaults)"),
}
for _dir in ("sdar-tiny-arith", "sdar-large", "fast-dllm-v2-tiny", "llada2-tiny", "qwen2-tiny-ar", "deer-drafter-tiny"):
    SHAPES[f"tiny:{_dir}"] = Shape(f"tiny:{_dir}", "bundled", {"dir": _dir}, f"models/{_dir}/config.json")

#: --shape -> group -> (target shape, drafter shape or None).
SCALES: dict[str, dict[str, tuple[str, str | None]]] = {
    "tiny": {"sdar": ("tiny:sdar-tiny-arith", None), "simsd": ("tiny:sdar-large", "tiny:sdar-tiny-arith"),
             "fast_dllm_v2": ("tiny:fast-dllm-v2-tiny", None), "llada2": ("tiny:llada2-tiny", None),
             "deer": ("tiny:qwen2-tiny-ar", "tiny:deer-drafter-tiny")},
    "1.7b": {"sdar": ("SDAR-1.7B", None), "simsd": ("SDAR-8B", "SDAR-1.7B"),
             "fast_dllm_v2": ("Fast-dLLM-v2-1.5B", None), "llada2": ("LLaDA2.1-mini", None),
             "deer": ("Qwen3-8B", "Open-dCoder-0.5B")},
    "8b": {"sdar": ("SDAR-8B", None), "simsd": ("SDAR-8B", "SDAR-1.7B"),
           "fast_dllm_v2": ("Fast-dLLM-v2-7B", None), "llada2": ("LLaDA2.1-mini", None),
           "deer": ("Qwen3-8B", "Open-dCoder-0.5B")},
}



def shape_config(shape: Shape):
    """The transformers config of `shape` (attention: SDPA)."""
    import hf_dllm_spec

    hf_dllm_spec.register_auto_classes()
    kwargs = dict(shape.config)
    if shape.family == "bundled":
        from transformers import AutoConfig

        cfg = AutoConfig.from_pretrained(MODELS_DIR / kwargs["dir"])
        hub_mask = {"Fast_dLLM_Qwen": "fast_dllm_v2", "llada2_moe": "llada2"}.get(cfg.model_type)
        if hub_mask and getattr(cfg, "mask_token_id", None) is None:
            # Families whose configs carry no mask id: the tokenizer files name it (as their from_pretrained does).
            import importlib

            from model_patches.hub_generate import mask_token_from_files

            token = importlib.import_module(f"model_patches.{hub_mask}").MASK_TOKEN
            cfg.mask_token_id = mask_token_from_files(str(MODELS_DIR / kwargs["dir"]), token)
    elif shape.family == "sdar":
        from model_patches.sdar import SDARConfig

        cfg = SDARConfig(**kwargs)
    elif shape.family == "qwen3":
        from transformers import Qwen3Config

        cfg = Qwen3Config(**kwargs)
    elif shape.family == "qwen2":
        from transformers import Qwen2Config

        cfg = Qwen2Config(**kwargs)
    elif shape.family == "fast_dllm_v2":
        from model_patches.fast_dllm_v2 import Fast_dLLM_QwenConfig

        cfg = Fast_dLLM_QwenConfig(**kwargs)
    elif shape.family == "llada2":
        from model_patches.llada2 import LLaDA2MoeConfig

        cfg = LLaDA2MoeConfig(**kwargs)
    else:
        raise ValueError(f"shape_config: `family` (={shape.family!r}) of shape {shape.name} must be one of bundled, "
                         "sdar, qwen3, qwen2, fast_dllm_v2, llada2; fix the SHAPES entry.")
    cfg._attn_implementation = "sdpa"
    return cfg


def count_parameters(shape: Shape) -> int:
    """Number of parameters of `shape` (built on the meta device: no memory)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(shape_config(shape))
    return sum(p.numel() for p in model.parameters())


def available_bytes(device: torch.device) -> int:
    """Free memory of `device` in bytes (CUDA: `mem_get_info`; CPU: MemAvailable of /proc/meminfo, else large)."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        for line in pathlib.Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 1 << 62


def _no_init_weights():
    """transformers' `no_init_weights` context (skip the library's weight init: `build_model` fills the weights
    itself), or a no-op context where this transformers has none (init then runs twice, only slower)."""
    import contextlib

    for module in ("transformers.initialization", "transformers.modeling_utils"):
        try:
            return importlib.import_module(module).no_init_weights()
        except (ImportError, AttributeError):
            continue
    return contextlib.nullcontext()


def build_model(shape: Shape, device: torch.device, dtype: torch.dtype, quant: str, seed: int):
    """A model of `shape` with random weights, in eval mode, on `device`.

    Weights: uniform in +-0.02*sqrt(3) (std 0.02, the usual `initializer_range`) from a `torch.Generator` seeded
    with `seed`; 1-D weights of norms are 1, biases 0. With `quant` "8bit" / "nf4" the random model is saved to a
    temporary directory and reloaded through `from_pretrained(..., quantization_config=BitsAndBytesConfig(...))`,
    the path real checkpoints take (the bf16 model is built on `device` first, so it must fit there too).

    Args:
        shape (`Shape`): what to build (`SHAPES`).
        device (`torch.device`): where the model lives.
        dtype (`torch.dtype`): parameter dtype; the compute dtype of quantized layers.
        quant (`str`): "none", "8bit" (LLM.int8) or "nf4" (4-bit NormalFloat), see `QUANTS`.
        seed (`int`): seed of the weights' generator.

    Raises:
        ValueError: `quant` unknown, or bitsandbytes missing for a quantized build.
    """
    from transformers import AutoModelForCausalLM

    if quant not in QUANTS:
        raise ValueError(f"build_model: `quant` (={quant!r}) must be one of {QUANTS}; pass one of them (--quant).")
    if quant != "none" and importlib.util.find_spec("bitsandbytes") is None:
        raise ValueError(f"--quant {quant} needs bitsandbytes, which is not installed: `pip install bitsandbytes` "
                         "(on a GPU machine without network, carry its wheel), or drop --quant.")
    build_dtype = dtype if quant == "none" else torch.bfloat16
    with torch.device(device), _no_init_weights():
        model = AutoModelForCausalLM.from_config(shape_config(shape), dtype=build_dtype)
    gen = torch.Generator(device=device).manual_seed(seed)
    bound = 0.02 * 3 ** 0.5
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 1:
                param.fill_(0.0 if name.endswith("bias") else 1.0)
            else:
                param.uniform_(-bound, bound, generator=gen)
    model.eval()
    if quant == "none":
        return model
    from transformers import BitsAndBytesConfig

    bnb = (BitsAndBytesConfig(load_in_8bit=True) if quant == "8bit" else
           BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=dtype))
    with tempfile.TemporaryDirectory(prefix="cost_model_") as tmp:
        model.save_pretrained(tmp)
        cls = type(model)
        del model
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        loaded = cls.from_pretrained(tmp, quantization_config=bnb, dtype=dtype,
                                     device_map=str(device) if device.type != "cuda" else {"": device.index or 0})
    if quant == "8bit":
        # LLM.int8 casts bf16 inputs to fp16 and logs it on every matmul.
        logging.getLogger("bitsandbytes").setLevel(logging.ERROR)
    return loaded.eval()

