"""`generate` integration: the `custom_generate` callable and the `GenerationMixin` layer on top of it.

Two entry points run the same code:

- any transformers causal LM: ``model.generate(ids, custom_generate=hf_dllm_spec.dllm_generate,
  decoding_strategy="s2d2", ...)``; transformers prepares the inputs, logits processors and stopping criteria,
  then calls :func:`dllm_generate`;
- models loaded through `model_patches` (e.g. SDAR): ``model.generate(ids, decoding_strategy="s2d2", ...)``;
  :class:`DllmGenerationMixin` routes the call to the same callable. Without `decoding_strategy` the stock
  `generate` runs unchanged.

Strategy parameters are keyword arguments of :func:`dllm_generate` (its signature lists every parameter of
every strategy, so transformers routes them to it and still rejects typos); they merge with a stored
``generation_config.dllm_decoding``, an optional `preset` and an optional `strategy_config` object.
"""

from __future__ import annotations

import inspect
import warnings
from typing import Any

import torch
from transformers import GenerationConfig, GenerationMixin, LogitsProcessorList
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from .configuration import CONFIG_CLASSES, DecodingConfig, config_class_for, resolve_config
from .outputs import GenerateDllmOutput, SpecDecodingStats
from .runner import ModelRunner
from .sampling import Sampler
from .strategies import STRATEGIES, DecodingSession
from .timing import now
from .validation import invalid

_UNSET: Any = type("Unset", (), {"__repr__": lambda self: "<unset>"})()

#: Model kwargs transformers prepares that the decoding loop reads or may ignore (it builds its own masks).
_KNOWN_MODEL_KWARGS = {"attention_mask", "position_ids", "past_key_values", "use_cache", "logits_to_keep",
                       "cache_position"}


def strategy_parameter_names() -> tuple[str, ...]:
    """Every parameter of every strategy config, in a stable order."""
    names: list[str] = []
    for cls in CONFIG_CLASSES.values():
        names += [n for n in cls.parameter_names() if n not in names]
    return tuple(names)


STRATEGY_PARAMETERS = strategy_parameter_names()


def _warpers_from_generation_config(generation_config: GenerationConfig) -> LogitsProcessorList:
    """Temperature / top-k / top-p warpers for direct calls that bypass `model.generate`."""
    procs = LogitsProcessorList()
    if generation_config.do_sample:
        if generation_config.temperature is not None and generation_config.temperature != 1.0:
            procs.append(TemperatureLogitsWarper(generation_config.temperature))
        if generation_config.top_k:
            procs.append(TopKLogitsWarper(generation_config.top_k))
        if generation_config.top_p is not None and generation_config.top_p < 1.0:
            procs.append(TopPLogitsWarper(generation_config.top_p))
    return procs


def _check_inputs(input_ids: torch.Tensor, generation_config: GenerationConfig,
                  model_kwargs: dict[str, Any]) -> None:
    """Reject what the decoding loop does not support, before any forward."""
    unknown = sorted(set(model_kwargs) - _KNOWN_MODEL_KWARGS)
    if unknown:
        raise invalid("model_kwargs", unknown, "be empty for hf_dllm_spec strategies",
                      "drop these arguments (the decoding loop builds its own inputs)")
    if input_ids.dim() != 2 or input_ids.shape[0] != 1:
        raise invalid("input_ids", tuple(input_ids.shape), "have shape (1, prompt_len): batch size 1 for now",
                      "decode prompts one at a time (num_return_sequences=1); batching is planned")
    mask = model_kwargs.get("attention_mask")
    if mask is not None and not bool((mask == 1).all()):
        raise invalid("attention_mask", f"<{int((mask == 0).sum())} padded positions>",
                      "have no padding while batches are not yet supported",
                      "pass the unpadded prompt with batch size 1")
    if generation_config.num_beams != 1:
        raise invalid("num_beams", generation_config.num_beams, "be 1 for hf_dllm_spec strategies",
                      "use num_beams=1")
    for flag in ("output_scores", "output_logits", "output_attentions", "output_hidden_states"):
        if getattr(generation_config, flag, False):
            raise invalid(flag, True, "be False for hf_dllm_spec strategies (per-token scores are not defined "
                          "for out-of-order commits)", f"drop `{flag}`; `return_dict_in_generate=True` "
                          "returns the statistics")


def _resolve_budget(input_ids: torch.Tensor, generation_config: GenerationConfig) -> int:
    if generation_config.max_new_tokens is not None:
        budget = generation_config.max_new_tokens
        name = "max_new_tokens"
    else:
        budget = generation_config.max_length - input_ids.shape[1]
        name = "max_length"
    if budget < 1:
        raise invalid(name, budget if name == "max_new_tokens" else generation_config.max_length,
                      "leave room for at least one new token", "pass max_new_tokens >= 1")
    return budget


def _resolve_block_size(patch, model, config: DecodingConfig) -> int:
    trained = patch.trained_block_size(model)
    block_size = config.block_size if config.block_size is not None else trained
    if block_size is None:
        raise invalid("block_size", None, f"be given: model_type `{model.config.model_type}` has no trained "
                      "block size in its config", "pass block_size=4 (or the size the model was trained with)")
    if trained is not None and block_size not in (1, trained):
        warnings.warn(
            f"`block_size` (={block_size}) differs from the checkpoint's trained block size (={trained}) for "
            f"model_type `{model.config.model_type}`: running off-distribution.", stacklevel=4,
        )
    return block_size


def _trim(generated: torch.Tensor, max_new_tokens: int, stop_ids: list[int]) -> torch.Tensor:
    """Cut to the budget, then after the first stop id (kept, HF convention)."""
    generated = generated[:max_new_tokens]
    if stop_ids:
        hits = torch.isin(generated, torch.tensor(stop_ids, device=generated.device)).nonzero()
        if hits.numel():
            generated = generated[: int(hits[0, 0]) + 1]
    return generated


@torch.no_grad()
def dllm_generate(
    model,
    input_ids: torch.Tensor,
    logits_processor: LogitsProcessorList | None = None,
    stopping_criteria=None,
    generation_config: GenerationConfig | None = None,
    synced_gpus: bool = False,
    streamer=None,
    *,
    decoding_strategy: str,
    generator: torch.Generator | None = None,
    mask_token_id: int | None = None,
    strategy_config: DecodingConfig | None = None,
    preset: str | None = None,
    **kwargs: Any,
):
    """Decode with a hf_dllm_spec strategy; the `custom_generate` callable of transformers' `generate`.

    Args:
        model (`PreTrainedModel`): a model of a family in `model_patches` (SDAR, Qwen2/3).
        input_ids (`torch.LongTensor` of shape `(1, prompt_len)`): the prompt.
        logits_processor (`LogitsProcessorList`, *optional*): prepared by `generate`; only position-independent
            processors (temperature, top-k, top-p, min-p, typical, epsilon, eta, suppress tokens) are accepted.
        stopping_criteria (`StoppingCriteriaList`, *optional*): evaluated after each finished block on the
            final tokens.
        generation_config (`GenerationConfig`, *optional*): `max_new_tokens`, `do_sample`, `eos_token_id`,
            `use_cache` (False recomputes every forward without a cache), `return_dict_in_generate`.
        decoding_strategy (`str`): "ar", "block_diffusion" or "s2d2".
        generator (`torch.Generator`, *optional*): the only source of randomness; the same seed gives the same
            tokens. Without it torch's global RNG is used.
        mask_token_id (`int`, *optional*): overrides the model's mask token.
        strategy_config (`DecodingConfig`, *optional*): a config object of the chosen strategy.
        preset (`str`, *optional*): a named configuration, e.g. "sdar-8b-config-a" for S2D2.
        **kwargs: strategy parameters (see the config classes) and the model kwargs transformers prepared.

    Returns:
        `torch.LongTensor` of shape `(1, prompt_len + n)`, the prompt and at most `max_new_tokens` new tokens
        (up to and including the first stop id); or `GenerateDllmOutput` with `spec_stats` when
        `return_dict_in_generate=True`.

    Raises:
        ValueError: unknown strategy, bad parameter, batch > 1, padding, missing mask token, budget < 1,
            prompt beyond the model's positions; all before any forward.
        NotImplementedError: an unsupported model family or logits processor.
    """
    generation_config = generation_config if generation_config is not None else model.generation_config
    overrides = {k: kwargs.pop(k) for k in list(kwargs) if k in STRATEGY_PARAMETERS and kwargs[k] is not _UNSET}
    for k in [k for k in kwargs if kwargs[k] is _UNSET]:
        kwargs.pop(k)
    config = resolve_config(decoding_strategy, generation_config=generation_config,
                            strategy_config=strategy_config, preset=preset, overrides=overrides)
    strategy_cls = STRATEGIES[config.decoding_strategy]
    _check_inputs(input_ids, generation_config, kwargs)

    import model_patches  # registry lookup; model_patches never imports this module at import time

    patch = model_patches.get_patch(model)
    if patch.alignment != "position":
        raise NotImplementedError(
            f"family {patch.family} is {patch.alignment}-aligned; the block-diffusion loop supports "
            "position-aligned families (SDAR, Qwen-as-SDAR) only so far."
        )
    resolved_mask = patch.mask_token_id(model, mask_token_id)
    if strategy_cls.requires_mask_token and resolved_mask is None:
        raise invalid("mask_token_id", None, f"be known for decoding_strategy={config.decoding_strategy!r}: "
                      f"model_type `{model.config.model_type}` has no `mask_token_id` in its config or generation "
                      "config", "pass mask_token_id=<id> to generate, or set config.mask_token_id")
    block_size = _resolve_block_size(patch, model, config)
    max_new_tokens = _resolve_budget(input_ids, generation_config)
    max_positions = patch.max_positions(model)
    needed = input_ids.shape[1] + -(-max_new_tokens // block_size) * block_size
    if max_positions is not None and needed > max_positions:
        raise invalid("input_ids", f"<prompt of {input_ids.shape[1]} tokens>",
                      f"fit with max_new_tokens={max_new_tokens} rounded up to whole blocks of {block_size} "
                      f"(= {needed} positions) in the model's {max_positions} positions",
                      "shorten the prompt or lower max_new_tokens")
    stop_ids = patch.stop_token_ids(model, generation_config)

    stats = SpecDecodingStats()
    prompt = input_ids[0].to(model.device)
    stop_check = None
    if stopping_criteria:
        def stop_check(generated: torch.Tensor) -> bool:
            seq = torch.cat([prompt, _trim(generated, max_new_tokens, stop_ids)])[None]
            return bool(stopping_criteria(seq, None).any())

    session = DecodingSession(
        prompt_ids=prompt,
        runner=ModelRunner(model, patch, stats, use_cache=bool(generation_config.use_cache),
                           cache=kwargs.get("past_key_values") if generation_config.use_cache else None),
        sampler=Sampler(logits_processor if logits_processor is not None
                        else _warpers_from_generation_config(generation_config),
                        do_sample=bool(generation_config.do_sample),
                        suppress_token_ids=[resolved_mask] if resolved_mask is not None else [],
                        generator=generator),
        stats=stats, mask_token_id=resolved_mask, stop_token_ids=stop_ids, max_new_tokens=max_new_tokens,
        stop_check=stop_check,
    )
    strategy = strategy_cls(config, session, block_size=block_size)
    t0 = now(model.device)
    generated = _trim(strategy.decode(), max_new_tokens, stop_ids)
    stats.wall_time_s = now(model.device) - t0
    stats.num_generated_tokens = generated.shape[0]
    stats.num_discarded_tokens = stats.num_committed_tokens - stats.num_generated_tokens
    sequences = torch.cat([prompt, generated])[None]
    if streamer is not None:
        streamer.put(generated.cpu())
        streamer.end()
    if generation_config.return_dict_in_generate:
        return GenerateDllmOutput(sequences=sequences, spec_stats=stats)
    return sequences


def _with_strategy_signature(fn):
    """Expose every strategy parameter as a keyword-only argument so transformers routes it to `fn`."""
    sig = inspect.signature(fn)
    params = [p for p in sig.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
    params += [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=_UNSET)
               for name in STRATEGY_PARAMETERS]
    params.append(inspect.Parameter("kwargs", inspect.Parameter.VAR_KEYWORD))
    fn.__signature__ = sig.replace(parameters=params)
    return fn


dllm_generate = _with_strategy_signature(dllm_generate)


class DllmGenerationMixin(GenerationMixin):
    """Adds `decoding_strategy=` to `generate`; without it the stock `generate` runs unchanged.

    >>> out = model.generate(input_ids, decoding_strategy="s2d2", max_new_tokens=64,
    ...                      generator=torch.Generator().manual_seed(0))  # doctest: +SKIP
    """

    def generate(self, *args, decoding_strategy: str | None = None, **kwargs):
        """`GenerationMixin.generate`, or :func:`dllm_generate` when `decoding_strategy` is given.

        Raises:
            ValueError: if both `decoding_strategy` and `custom_generate` are given, or an unknown strategy.
        """
        if decoding_strategy is None:
            return super().generate(*args, **kwargs)
        config_class_for(decoding_strategy)  # unknown names fail here, before input preparation
        if kwargs.get("custom_generate") is not None:
            raise invalid("custom_generate", kwargs["custom_generate"],
                          "be unset when `decoding_strategy` is given", "pass only one of them")
        # transformers does not forward `streamer` to a custom_generate callable; feed it here instead:
        # the prompt, then the final tokens in one chunk (diffusion blocks finish out of order), then end().
        streamer = kwargs.pop("streamer", None)
        out = super().generate(*args, custom_generate=dllm_generate, decoding_strategy=decoding_strategy, **kwargs)
        if streamer is not None:
            sequences = out if isinstance(out, torch.Tensor) else out.sequences
            prompt = args[0] if args else kwargs.get("inputs", kwargs.get("input_ids"))
            streamer.put(sequences[:, : prompt.shape[1]].cpu())
            streamer.put(sequences[0, prompt.shape[1]:].cpu())
            streamer.end()
        return out
