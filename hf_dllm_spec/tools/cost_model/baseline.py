"""The AR baseline of the static-runtime mode of the cost model (`--runtime static`, `hf-dllm-spec bench-gpu`):
stock transformers `generate(cache_implementation="static")` greedy AR on a stock model class with the dimensions
of a shape, timed in the same process as the shape's forwards.

- Which stock class (:func:`stock_twin`): Qwen3ForCausalLM for the Qwen3-layout shapes (SDAR, Qwen3, the DEER
  drafter built as SDAR), Qwen2ForCausalLM for the Qwen2 layouts (Fast-dLLM v2, the bundled Qwen2 AR model); a
  shape that is already a stock class is used as it is. A shape with no stock class (LLaDA2 MoE) is timed with
  the library's own AR (`decoding_strategy="ar"`) under the static runtime instead, and the result says so.
- Whether transformers compiled it: `generate` compiles the decode step when
  `GenerationMixin._valid_auto_compile_criteria` returns True (an accelerator, a compileable cache such as the
  static one, no bitsandbytes quantizer that refuses it, no CPU/disk offload); the decision is read from that very
  method during the warm-up call (`hf_dllm_spec.bridge.spy_compile_decision`), not re-derived.
- What is timed (:func:`time_ar_steps`): after a warm-up call of `new_tokens` tokens (on CUDA: the compilation)
  and one of a single token, `reps` interleaved pairs of calls with `new_tokens` and with 1 new token (EOS
  disabled, greedy, the same prompt); the decode step is (t(new_tokens) - t(1)) / (new_tokens - 1), the marginal
  cost of one generated token with the prefill taken out. The first call fixes the static cache length
  (transformers keeps the largest `max_cache_len` across calls), so the shorter calls neither reallocate nor
  recompile.

Source: issue 25; transformers `GenerationMixin.generate` / `_valid_auto_compile_criteria` / `_prepare_static_cache`
(5.17-5.24); the H100 figures in `shared/reference/platform.md` ("Static caches, compilation and CUDA graphs").
"""

from __future__ import annotations

import gc
import statistics
from typing import Callable

import torch

from hf_dllm_spec.bridge import spy_compile_decision
from hf_dllm_spec.runtime.timing import now

from .shapes import Shape, available_bytes, build_model, count_parameters, shape_config

#: Config fields a stock twin copies from the shape's config (the dimensions; the rest keeps the stock defaults).
TWIN_FIELDS = {"qwen3": ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                         "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps",
                         "tie_word_embeddings", "attention_bias", "rope_parameters"),
               "qwen2": ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                         "num_key_value_heads", "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings",
                         "rope_parameters")}


def stock_twin(shape: Shape) -> Shape | None:
    """The stock transformers shape with `shape`'s dimensions, `shape` itself when it is already a stock class, or
    None when transformers has no class of its layout (LLaDA2 MoE).

    The family is read from the config's class: a subclass of `Qwen3Config` (SDAR) gets `Qwen3ForCausalLM`, of
    `Qwen2Config` (Fast-dLLM v2) `Qwen2ForCausalLM`, with the fields of :data:`TWIN_FIELDS` copied.
    """
    from transformers import Qwen2Config, Qwen3Config

    cfg = shape_config(shape)
    if type(cfg) in (Qwen3Config, Qwen2Config):
        return shape
    for base, family in ((Qwen3Config, "qwen3"), (Qwen2Config, "qwen2")):
        if isinstance(cfg, base):
            fields = {k: getattr(cfg, k) for k in TWIN_FIELDS[family] if getattr(cfg, k, None) is not None}
            name = f"{base.__name__.removesuffix('Config')}ForCausalLM ({shape.name} dims)"
            return Shape(name, family, fields, f"stock twin of {shape.name} ({shape.source})")
    return None


def time_ar_steps(call: Callable[[int], None], device: torch.device, *, new_tokens: int, reps: int,
                  stat: Callable = statistics.median) -> dict:
    """Seconds per decode step of an AR `generate`: (t(new_tokens) - t(1)) / (new_tokens - 1).

    Args:
        call (`Callable[[int], None]`): runs one `generate` call for that many new tokens (EOS disabled).
        device (`torch.device`): synchronised around each call (`hf_dllm_spec.runtime.timing.now`).
        new_tokens (`int`): tokens of the long call, >= 2.
        reps (`int`): timed pairs of calls (long, single token), interleaved, >= 1.
        stat: summary of the repeats (`statistics.median` or `min`).

    Returns:
        `dict`: "step_s" (seconds per decode step), "call_s" (the long call), "prefill_call_s" (the one-token
        call), "per_token_s" (call_s / new_tokens, prefill included), "new_tokens", "reps".

    Raises:
        ValueError: if `new_tokens` < 2 or `reps` < 1.
    """
    if new_tokens < 2 or reps < 1:
        raise ValueError(f"time_ar_steps: `new_tokens` (={new_tokens}) must be >= 2 and `reps` (={reps}) >= 1; "
                         "pass --stock-tokens 2 or more and --stock-reps 1 or more.")
    call(new_tokens)                      # warm-up: compiles on CUDA, sets the static cache length
    call(1)
    long, short = [], []
    for _ in range(reps):
        for n, times in ((new_tokens, long), (1, short)):
            t0 = now(device)
            call(n)
            times.append(now(device) - t0)
    call_s, prefill_s = float(stat(long)), float(stat(short))
    return {"step_s": (call_s - prefill_s) / (new_tokens - 1), "call_s": call_s, "prefill_call_s": prefill_s,
            "per_token_s": call_s / new_tokens, "new_tokens": new_tokens, "reps": reps}


def _prompt(model, prompt_tokens: int, seed: int) -> torch.Tensor:
    gen = torch.Generator(device="cpu").manual_seed(seed)
    vocab = int(model.config.vocab_size)
    ids = torch.randint(3, min(vocab, 1000), (1, prompt_tokens), generator=gen)
    mask_id = getattr(model.config, "mask_token_id", None)
    if mask_id is not None:
        ids[ids == mask_id] = 3
    return ids.to(model.device)


def _check_length(out, prompt: torch.Tensor, n: int, what: str) -> None:
    sequences = out.sequences if hasattr(out, "sequences") else out
    got = int(sequences.shape[1]) - int(prompt.shape[1])
    if got != n:
        raise RuntimeError(f"{what}: generated {got} tokens instead of max_new_tokens={n} although EOS was "
                           "disabled (eos_token_id=None); the baseline needs every call to run to its budget.")


def stock_ar_step(model, *, prompt_tokens: int, new_tokens: int, reps: int, seed: int,
                  stat: Callable = statistics.median) -> dict:
    """Stock transformers `generate(cache_implementation="static")`, greedy AR, on `model` (a stock class).

    `do_sample=False`, EOS disabled (`eos_token_id=None`), a random prompt of `prompt_tokens` tokens; timed by
    :func:`time_ar_steps`. "compiled" is transformers' own decision in these calls
    (`hf_dllm_spec.bridge.spy_compile_decision`).

    Returns:
        :func:`time_ar_steps`' dict plus "baseline" ("stock"), "class", "compiled" (`bool`, or None when this
        transformers has no `_valid_auto_compile_criteria`) and "compile_note" (one line: why).

    Raises:
        RuntimeError: if a call stops before its budget.
    """
    ids = _prompt(model, prompt_tokens, seed)
    if model.device.type == "cuda":
        # Every stock twin shares the Qwen2/Qwen3 forward's code object, hence dynamo's recompile budget for it
        # (`cache_size_limit`, past which it silently runs eager): a fresh budget per baseline.
        torch._dynamo.reset()
    decision, restore = spy_compile_decision(model)

    def call(n: int) -> None:
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n,
                             eos_token_id=None, pad_token_id=0, cache_implementation="static")
        _check_length(out, ids, n, f"stock generate ({type(model).__name__})")

    try:
        timing = time_ar_steps(call, model.device, new_tokens=new_tokens, reps=reps, stat=stat)
    finally:
        restore()
    compiled = decision()
    note = {True: "compiled by generate (transformers' `_valid_auto_compile_criteria` returned True: the decode "
                  "step runs `model.get_compiled_call(compile_config)`)",
            False: f"not compiled: transformers' `_valid_auto_compile_criteria` returned False (on {model.device.type}"
                   f"{': transformers compiles only on accelerators' if model.device.type == 'cpu' else ''})",
            None: "unknown: this transformers has no `_valid_auto_compile_criteria`"}[compiled]
    return dict(timing, baseline="stock", **{"class": type(model).__name__}, compiled=compiled, compile_note=note)


def library_ar_step(model, *, prompt_tokens: int, new_tokens: int, reps: int, seed: int,
                    stat: Callable = statistics.median) -> dict:
    """The library's AR (`decoding_strategy="ar"`) under the static runtime on `model`, timed as
    :func:`stock_ar_step`: the baseline of a shape without a stock transformers class.

    Returns:
        :func:`time_ar_steps`' dict plus "baseline" ("library AR, static runtime"), "class", "compiled" (True when
        the static runtime captures CUDA graphs or compiles) and "compile_note" (`compile_plan`'s mode and reason).
    """
    from transformers import GenerationConfig

    from hf_dllm_spec.integration.generate import dllm_generate
    from hf_dllm_spec.integration.mixin import DllmGenerationMixin
    from hf_dllm_spec.runtime.static import compile_plan

    ids = _prompt(model, prompt_tokens, seed)
    entry = {} if isinstance(model, DllmGenerationMixin) else {"custom_generate": dllm_generate}

    def call(n: int) -> None:
        out = model.generate(ids, attention_mask=torch.ones_like(ids), decoding_strategy="ar", max_new_tokens=n,
                             eos_token_id=None, cache_implementation="static", return_dict_in_generate=True, **entry)
        _check_length(out, ids, n, f"library AR ({type(model).__name__})")

    timing = time_ar_steps(call, model.device, new_tokens=new_tokens, reps=reps, stat=stat)
    mode, reason = compile_plan(model, GenerationConfig(cache_implementation="static"))
    return dict(timing, baseline="library AR, static runtime", **{"class": type(model).__name__},
                compiled=mode != "eager", compile_note=f"static runtime: {mode}" + (f" ({reason})" if reason else ""))


def measure_baseline(shape: Shape, model, *, device: torch.device, dtype: torch.dtype, quant: str, seed: int,
                     prompt_tokens: int, new_tokens: int, reps: int, stat: Callable = statistics.median,
                     needed_bytes: int = 0) -> dict:
    """The AR baseline of `shape`, whose library model `model` is built: stock `generate` on its stock twin
    (`model` itself when it is a stock class; else a twin built with the same seed, dtype and quantization, freed
    afterwards), or the library's AR on `model` when no stock class exists.

    Args:
        needed_bytes (`int`): memory a twin needs on `device`; with less free, the baseline is skipped.

    Returns:
        the timing dict of :func:`stock_ar_step` / :func:`library_ar_step`, plus "shape" (the model timed) and
        "stock_class_exists"; or `{"skipped": reason}` when the twin does not fit.
    """
    twin = stock_twin(shape)
    args = dict(prompt_tokens=prompt_tokens, new_tokens=new_tokens, reps=reps, seed=seed, stat=stat)
    if twin is None:
        return dict(library_ar_step(model, **args), shape=shape.name, stock_class_exists=False,
                    note=f"transformers has no stock class for {shape.name}'s layout; baseline = the library's AR "
                         "under the static runtime")
    if twin is shape:
        return dict(stock_ar_step(model, **args), shape=shape.name, stock_class_exists=True)
    free = available_bytes(device)
    if needed_bytes > free:
        return {"skipped": f"the stock twin needs about {needed_bytes / 2**30:.1f} GiB, {free / 2**30:.1f} GiB free "
                           f"on {device}", "shape": twin.name, "stock_class_exists": True}
    stock = build_model(twin, device, dtype, quant, seed)
    try:
        return dict(stock_ar_step(stock, **args), shape=twin.name, stock_class_exists=True,
                    params=count_parameters(twin))
    finally:
        del stock
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
