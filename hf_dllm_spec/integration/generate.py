"""`generate` integration: the `custom_generate` callable that every entry point runs.

Three entry points, one code path:

- any transformers causal LM: ``model.generate(ids, custom_generate=hf_dllm_spec.custom_generate,
  decoding_strategy="s2d2", ...)``; transformers prepares the inputs, logits processors and stopping criteria,
  then calls :func:`dllm_generate`;
- model classes with :class:`~hf_dllm_spec.integration.mixin.DllmGenerationMixin` (e.g. SDAR):
  ``model.generate(ids, decoding_strategy="s2d2", ...)`` routes to the same callable;
- the Hub folder `custom_generate/generate.py` hands the call back to transformers' `generate` with it.

transformers does not pass `streamer` or `assistant_model` to a `custom_generate` callable (it puts the prompt
on the streamer and drops both). :func:`dllm_generate` reads them from the `generate` call that invoked it, so
a streamer receives the final tokens and `end()`, and `assistant_model` is an alias of `draft_model`. Called
directly, :func:`dllm_generate` hands itself to transformers' `generate`, so every entry point prepares
processors, stopping criteria and generation options the same way.

Strategy parameters are keyword arguments of :func:`dllm_generate` (its signature lists every parameter of
every registered strategy, so transformers routes them to it and still rejects typos; registering a strategy
refreshes it); they merge with a stored ``generation_config.dllm_decoding``, an optional `preset` and an optional
`strategy_config` object.

One call: :func:`~hf_dllm_spec.integration.plan.build_plan` resolves and checks everything before any forward, the
runtimes and the session are made from the plan, the strategy decodes, :class:`~hf_dllm_spec.integration.rows
.RowEnds` cuts each row, the output is assembled. Every contact with transformers' private behaviour (reading the
`generate` call's frame, the signature routing, the hand-off of a direct call) goes through
:mod:`hf_dllm_spec.bridge`.
"""

from __future__ import annotations

import contextlib
import contextvars
import inspect
from typing import Any

import torch
from transformers import GenerationConfig, LogitsProcessorList

from model_patches.compat import find_cache
from model_patches.generation import stored_decoding_strategy

from ..bridge import generate_call_arguments, generate_with_callable, route_keywords
from ..configuration import DecodingConfig
from ..maths.sampling import Sampler, active_processors
from ..outputs import BatchStats, GenerateDllmOutput
from ..runtime.runner import DRAFT_MODEL_SPAN
from ..runtime.static import hold_static_runtime, make_runner
from ..strategies import DecodingSession
from ..strategies.registry import STRATEGIES, get_strategy, on_register, strategy_parameter_names
from ..strategies.streaming import TokenStream
from ..validation import invalid
from .checks import check_call
from .plan import DecodePlan, build_plan, check_row
from .rows import FeedAdmission, RowEnds, RowFeed, criteria_to_scan, stop_strings_as_criteria

_UNSET: Any = type("Unset", (), {"__repr__": lambda self: "<unset>"})()


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
    decoding_strategy: str | None = None,
    generator: torch.Generator | list[torch.Generator] | None = None,
    mask_token_id: int | None = None,
    strategy_config: DecodingConfig | None = None,
    preset: str | None = None,
    draft_model=None,
    assistant_model=None,
    draft_mask_token_id: int | None = None,
    stop_strings: str | list[str] | None = None,
    row_feed: RowFeed | None = None,
    **kwargs: Any,
):
    """Decode with a hf_dllm_spec strategy; the `custom_generate` callable of transformers' `generate`.

    Args:
        model (`PreTrainedModel`): the target, a model of a family in `model_patches` (SDAR, Qwen2/3).
        input_ids (`torch.LongTensor` of shape `(N, P)`): the prompts, left-padded (`attention_mask` says where).
        logits_processor (`LogitsProcessorList`, *optional*): prepared by `generate`; only processors that read
            each position's logits alone are accepted (temperature, top-k, top-p, min-p, typical, epsilon, eta,
            top-h, suppress tokens, single-token bad words and sequence bias, renormalisation, inf/NaN removal).
        stopping_criteria (`StoppingCriteriaList`, *optional*): called as transformers calls them, once per
            position on the final tokens (`scores=None`); each row ends at the exact token where one first fires.
        generation_config (`GenerationConfig`, *optional*): `max_new_tokens`, `do_sample`, `eos_token_id`,
            `pad_token_id`, `use_cache` (False recomputes every forward without a cache),
            `return_dict_in_generate`.
        streamer (`BaseStreamer`, *optional*): receives the prompt, final tokens as soon as they are final, then
            `end()` (batch size 1). Through `generate`, the streamer passed there (transformers drops it for
            callables; it is read from the call).
        decoding_strategy (`str`, *optional*): a registered strategy: "ar", "block_diffusion", "s2d2", ...; without
            it, the one stored in the generation config (the call's, else the model's `dllm_decoding`).
        generator (`torch.Generator` or a list of them, *optional*): the only source of randomness; the same seed
            gives the same tokens. Without it torch's global RNG is used. A list (or tuple) holds one generator per
            row (length N, each on the model's device): every random draw of row i comes from generator i, so each
            row gets the tokens of its prompt decoded alone with that generator (`generator=[g]`), whatever the
            batch (per-request seeds). Per row, per step: the denoising step's token draw, then the row's
            verification (uniforms, then the recovered or bonus token); the full order is in
            :mod:`hf_dllm_spec.maths.sampling`.
        mask_token_id (`int`, *optional*): overrides the target's mask token.
        strategy_config (`DecodingConfig`, *optional*): a config object of the chosen strategy.
        preset (`str`, *optional*): a named configuration, e.g. "sdar-8b-config-a" for S2D2.
        draft_model (`PreTrainedModel`, *optional*): the drafter of strategies that use one (SimSD, DEER). It
            keeps its own device, dtype and `device_map` (accelerate offload): token ids go to its execution
            device and its block logits come back to the target's; caches never move (docs/placement.md).
        assistant_model (`PreTrainedModel`, *optional*): transformers' name for it; an alias of `draft_model`.
        draft_mask_token_id (`int`, *optional*): overrides the drafter's mask token.
        stop_strings (`str` or `list[str]`, *optional*): transformers' stop strings, with `tokenizer=` as for stock
            `generate`. A parameter of the callable, so transformers hands them over instead of refusing them: it
            drops `tokenizer` before calling a `custom_generate` callable (the tokenizer is read from the call).
        row_feed (`RowFeed`, *optional*): continuous batching: the call's rows as requests (one per row of
            `input_ids`, each with its own budget, generator and callbacks) and the requests that join the running
            batch at the strategy's join points (:mod:`hf_dllm_spec.integration.rows`); every row's result
            goes to its `on_done`.
        **kwargs: strategy parameters (see the config classes) and the model kwargs transformers prepared.

    Returns:
        `torch.LongTensor` of shape `(N, P + n)`: the prompts as given, then each row's new tokens (at most
        `max_new_tokens`, up to and including the first stop id), right-padded with `pad_token_id`; or
        `GenerateDllmOutput` with `spec_stats` and `spec_stats_per_row` when `return_dict_in_generate=True`.

    Raises:
        ValueError: unknown strategy, bad parameter, right padding, missing mask token, budget < 1, prompt
            beyond the model's positions, a streamer with batch > 1, a drafter where none is used (or none where
            one is needed), a drafter with another vocabulary; all before any forward.
        NotImplementedError: an unsupported model family or logits processor.
    """
    call = generate_call_arguments(model)
    streamer = streamer if streamer is not None else call.get("streamer")
    with ending_streamer(streamer):                    # a refused call, or transformers' preparation failing
        if decoding_strategy is None:
            decoding_strategy = _stored_strategy(model, generation_config)
        if stop_strings is not None:
            tokenizer = kwargs.pop("tokenizer", None)                          # a direct call keeps it
            tokenizer = tokenizer if tokenizer is not None else call.get("tokenizer")
            stopping_criteria = stop_strings_as_criteria(
                {"stop_strings": stop_strings, "tokenizer": tokenizer, "stopping_criteria": stopping_criteria})[
                "stopping_criteria"]
        if not call:
            check_call(model, (input_ids,), {**kwargs, "generation_config": generation_config, "streamer": streamer})
            # A direct call: hand it to transformers' `generate` with this callable, so the logits processors,
            # stopping criteria and generation options are prepared exactly as on the other entry points.
            return generate_with_callable(
                model, input_ids, generation_config=generation_config, logits_processor=logits_processor,
                stopping_criteria=stopping_criteria, streamer=streamer, assistant_model=assistant_model,
                custom_generate=dllm_generate, decoding_strategy=decoding_strategy, generator=generator,
                mask_token_id=mask_token_id, strategy_config=strategy_config, preset=preset, draft_model=draft_model,
                draft_mask_token_id=draft_mask_token_id, row_feed=row_feed, **kwargs)
    with ending_streamer(streamer, always=True):       # always: also when a check or the decoding fails
        generation_config = generation_config if generation_config is not None else model.generation_config
        names = _routed_parameter_names()
        overrides = {k: kwargs.pop(k) for k in list(kwargs) if k in names and kwargs[k] is not _UNSET}
        for k in [k for k in kwargs if kwargs[k] is _UNSET]:
            kwargs.pop(k)
        plan = build_plan(model, input_ids, generation_config, kwargs, decoding_strategy=decoding_strategy,
                          overrides=overrides, strategy_config=strategy_config, preset=preset,
                          draft_model=_draft_model(draft_model, assistant_model, call), mask_token_id=mask_token_id,
                          draft_mask_token_id=draft_mask_token_id, generator=generator, streamer=streamer,
                          stopping_criteria=stopping_criteria, raw_attention_mask=call.get("attention_mask"),
                          row_feed=row_feed)
        return _decode(plan, input_ids, logits_processor, kwargs, streamer)


def _stored_strategy(model, generation_config) -> str:
    """The strategy stored in the call's generation config, else in the model's (`dllm_decoding`)."""
    stored = stored_decoding_strategy(generation_config, getattr(model, "generation_config", None))
    if stored is None:
        raise invalid("decoding_strategy", None, "be given, or stored in the generation config (`dllm_decoding`, "
                      "written by `DecodingConfig.save_to_generation_config`)",
                      "pass decoding_strategy='s2d2' (or another registered strategy)")
    check_strategy_name(stored, generation_config, getattr(model, "generation_config", None))
    return stored


#: Per outermost entry: the streamers already ended (the callable ends its streamer inside transformers' `generate`,
#: and the same error then leaves the entry that called transformers). The objects themselves, compared by identity:
#: an id could be a new streamer's, made in the same entry after an ended one was freed.
_ENDED: contextvars.ContextVar[list | None] = contextvars.ContextVar("hf_dllm_spec_ended_streamers", default=None)


@contextlib.contextmanager
def ending_streamer(streamer, always: bool = False):
    """End `streamer` when the block raises (then re-raise), or, with `always`, whenever the block ends: a consumer
    iterating a `TextIteratorStreamer` never waits forever for a call that failed (a refused argument, transformers'
    own preparation of the call, the decoding). The blocks of one entry, nested through transformers' `generate`,
    end a streamer once between them (`TextStreamer.end()` prints a line each time); so does a call nested in
    another (from a stopping criterion, say) given the same streamer object: the first of them to finish ends it."""
    token = _ENDED.set([]) if _ENDED.get() is None else None
    try:
        yield
    except BaseException:
        _end_once(streamer)
        raise
    else:
        if always:
            _end_once(streamer)
    finally:
        if token is not None:
            _ENDED.reset(token)


def _end_once(streamer) -> None:
    ended = _ENDED.get()
    if streamer is None or not callable(getattr(streamer, "end", None)) or any(s is streamer for s in ended):
        return
    ended.append(streamer)
    streamer.end()


def _draft_model(draft_model, assistant_model, call: dict[str, Any]):
    """`draft_model`, or transformers' `assistant_model` as its alias (also when transformers dropped it)."""
    assistant_model = assistant_model if assistant_model is not None else call.get("assistant_model")
    if assistant_model is None:
        return draft_model
    if draft_model is not None and draft_model is not assistant_model:
        raise invalid("assistant_model", type(assistant_model).__name__,
                      "not be given together with a different `draft_model`", "pass only `draft_model`")
    return assistant_model


def _decode(plan: DecodePlan, input_ids: torch.Tensor, logits_processor, model_kwargs: dict[str, Any], streamer):
    """Session, strategy and output for a checked `plan` (the one static call per model held meanwhile)."""
    ends = RowEnds(plan.max_new_tokens, plan.stop_ids, plan.criteria, input_ids, plan.pad_id)
    with hold_static_runtime(plan.generation_config, plan.model, plan.draft_model):
        session = _session(plan, input_ids, logits_processor, model_kwargs, streamer, ends)
        with session.target.timer.span("wall"):
            generated = plan.strategy(plan.config, session).decode()[:plan.batch_size]
    rows = session.admission if session.admission is not None else ends      # a continuous batch's rows end alone
    return _output(plan, input_ids, rows.finish(generated), session)


def _session(plan: DecodePlan, input_ids, logits_processor, model_kwargs, streamer, ends: RowEnds) -> DecodingSession:
    """The strategy's session: the prompts, a runtime per model (the target's forward timer shared by the drafter),
    the counters, the sampler, the stop rule, the stream and the rows that join (continuous batching)."""
    stream = TokenStream(streamer, lambda final: ends.output_tokens(0, final)) if streamer is not None else None
    stats = BatchStats(plan.batch_size)
    admission = (FeedAdmission(plan.row_feed, plan.stop_ids, lambda ids, budget: check_row(plan, ids, budget),
                               lambda prompt_index: stats.per_row[prompt_index], plan.strategy, plan.do_sample)
                 if plan.row_feed is not None else None)
    runners = dict(stats=stats, batch_size=plan.batch_size, use_cache=plan.use_cache,
                   generation_config=plan.generation_config, max_cache_len=plan.cache_len)
    target = make_runner(plan.model, plan.patch, cache=find_cache(model_kwargs) if plan.use_cache else None, **runners)
    width = input_ids.shape[1]
    session = DecodingSession(
        prompts=[input_ids[n, width - plan.lengths[n]:].to(plan.device) for n in range(plan.batch_size)],
        target=target,
        sampler=Sampler(active_processors(logits_processor, width), do_sample=plan.do_sample,
                        suppress_token_ids=list(plan.suppress_ids), generator=plan.generator, device=plan.device),
        stats=stats, mask_token_id=plan.mask_token_id if plan.mask_token_id is not None else 0,
        stop_token_ids=list(plan.stop_ids), max_new_tokens=plan.max_new_tokens, stop_check=ends.stop_check,
        drafter=make_runner(plan.draft_model, plan.drafter_patch, timer=target.timer, timer_span=DRAFT_MODEL_SPAN,
                            **runners) if plan.draft_model is not None else None,
        draft_mask_token_id=plan.draft_mask_token_id, draft_block_size=plan.draft_block_size,
        stream=stream,
    )
    if admission is not None:
        admission.attach(session)
    return session


def _output(plan: DecodePlan, input_ids, generated: list[torch.Tensor], session: DecodingSession):
    """The sequences `(N, P + n)` (right-padded with the pad id), with the statistics when asked (the session's
    counters, the times of its target's timer, which runtime ran)."""
    width = max(g.shape[0] for g in generated)
    new = torch.full((plan.batch_size, width), plan.pad_id if plan.pad_id is not None else 0, dtype=torch.long,
                     device=plan.device)
    for n, g in enumerate(generated):
        new[n, : g.shape[0]] = g
    sequences = torch.cat([input_ids.to(plan.device), new], dim=1)
    stats, timer = session.stats, session.target.timer
    runtime = "; ".join(f"{role}: {runner.runtime_note}"
                        for role, runner in (("target", session.target), ("drafter", session.drafter)) if runner)
    stats.flush()
    for n, row in enumerate(stats.per_row[:plan.batch_size]):
        row.record_output(generated[n].shape[0])
        row.wall_time_s, row.forward_time_s, row.prefill_time_s = (timer.total("wall"), timer.total("forward"),
                                                                   timer.total("prefill"))
        row.draft_model_time_s, row.warmup_time_s = timer.total(DRAFT_MODEL_SPAN), timer.total("warmup")
        row.runtime = runtime
    if plan.generation_config.return_dict_in_generate:
        return GenerateDllmOutput(sequences=sequences, spec_stats=stats.total(),
                                  spec_stats_per_row=stats.per_row[:plan.batch_size])
    return sequences


def check_strategy_name(decoding_strategy, *generation_configs) -> None:
    """Refuse an unregistered `decoding_strategy` before any preparation, naming where it came from: the stored
    `dllm_decoding` of the first of `generation_configs` (each a `GenerationConfig` or None) that stores it, else
    the argument.

    Raises:
        ValueError: an unknown name, listing the registered ones.
    """
    if isinstance(decoding_strategy, str) and decoding_strategy not in STRATEGIES \
            and stored_decoding_strategy(*generation_configs) == decoding_strategy:
        names = ", ".join(map(repr, tuple(STRATEGIES)))
        raise invalid("generation_config.dllm_decoding['decoding_strategy']", decoding_strategy,
                      f"name a registered strategy ({names})",
                      "pass decoding_strategy=..., register the strategy (or install its plugin), or store a "
                      "registered one with `DecodingConfig.save_to_generation_config`")
    get_strategy(decoding_strategy)


_BASE_SIGNATURE = inspect.signature(dllm_generate)


def _routed_parameter_names() -> set[str]:
    """The strategy parameters transformers routed this call's keywords against: the keyword-only parameters
    :func:`refresh_signature` added to the callable's signature (not the registry itself, which a registration
    running meanwhile may hold a refused entry in)."""
    return {name for name, p in inspect.signature(dllm_generate).parameters.items() if p.default is _UNSET}


def refresh_signature() -> None:
    """Expose every registered strategy parameter as a keyword-only argument of :func:`dllm_generate`, so
    transformers routes it to the callable (and still rejects typos); run again on every `register_strategy`."""
    route_keywords(dllm_generate, _BASE_SIGNATURE, strategy_parameter_names(), _UNSET)


on_register(refresh_signature)

__all__ = ["criteria_to_scan", "dllm_generate", "ending_streamer", "refresh_signature", "stop_strings_as_criteria"]
