"""DEER's drafter as a transformers `CandidateGenerator`, for transformers' own assisted decoding.

transformers' `_assisted_decoding` verifies candidates with the target, crops its cache and, with
`do_sample=True` and candidate logits, accepts by `_speculative_sampling` (Leviathan et al. 2023 Algorithm 1;
the same rule as DEER Eq. 5-6). It supports batch size 1. :class:`DeerCandidateGenerator` supplies the k
candidates of one drafter forward (:class:`~hf_dllm_spec.strategies.drafting.OneStepDrafter`) and their processed draft
distribution; :func:`deer_assisted_generate` runs `model.generate(..., assistant_model=drafter)` with it.

transformers builds its candidate generator inside `generate` (`GenerationMixin._get_candidate_generator`)
and has no argument for a user's generator, so :func:`deer_assisted_generate` replaces that method on the
target *instance* for the duration of the call (restored afterwards, also on error). The strategy path,
``generate(custom_generate=hf_dllm_spec.custom_generate, decoding_strategy="deer", draft_model=...)``, needs no
such hook, runs batches and takes a `torch.Generator`; both give the same greedy tokens (tested).
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
from typing import Any

import torch
from transformers import LogitsProcessorList
from transformers.generation.candidate_generator import CandidateGenerator

import model_patches

from .plan import check_drafter_tokens, check_model_kinds, check_token_id, check_vocabulary
from ..strategies.deer import DeerStrategy
from ..strategies.drafting import OneStepDrafter
from ..outputs import BatchStats
from ..runtime.weights import check_weights
from ..runtime.runner import ModelRunner
from ..maths.sampling import Sampler, active_processors
from ..validation import check_int, invalid


class DeerCandidateGenerator(CandidateGenerator):
    """Candidates from one forward of a diffusion drafter conditioned on the committed prefix (DEER §3.2).

    Args:
        draft_model (`PreTrainedModel`): a diffusion LM of a family `model_patches` knows.
        num_draft_tokens (`int`, defaults to 32): k per cycle (capped so the candidates fit `max_length`).
        logits_processor (`LogitsProcessorList`, *optional*): the target's processors (transformers passes
            them); applied to the draft logits too, so the draft and target distributions carry the same
            transform.
        do_sample (`bool`, defaults to False): sample drafts from the processed distribution (else argmax).
        max_length (`int`, *optional*): the call's `max_length` (prompt included).
        mask_token_id (`int`, *optional*): the drafter's mask token (default: the drafter's own); suppressed in
            the draft distribution.
        draft_attention, sep_token_id, sep_position: as in `DeerConfig`.
        generator (`torch.Generator`, *optional*): for the draft samples (transformers' acceptance uses the
            global RNG).
        stop_token_ids (`list[int]`, *optional*): the stop ids of the call; the mask token must not be one.
        role (`str`, defaults to "draft_model"): the argument that passed the drafter, named in the errors
            ("assistant_model" for transformers' stock assisted decoding).

    Attributes:
        stats (`BatchStats`): drafter forwards ("draft") of this generator.

    Raises:
        ValueError: the drafter has no mask token, or one (or a `sep_token_id`) outside its vocabulary, or a mask
            token among `stop_token_ids`; a bad `num_draft_tokens`; a drafter on the meta device; a quantized
            drafter that cannot decode (:func:`hf_dllm_spec.runtime.weights.check_weights`).
    """

    def __init__(self, draft_model, *, num_draft_tokens: int = 32, logits_processor: LogitsProcessorList | None = None,
                 do_sample: bool = False, max_length: int | None = None, mask_token_id: int | None = None,
                 draft_attention: str = "causal_prefix", sep_token_id: int | None = None,
                 sep_position: str = "after_masks", generator: torch.Generator | None = None,
                 stop_token_ids: list[int] | None = None, role: str = "draft_model") -> None:
        check_int("num_draft_tokens", num_draft_tokens, 1, "pass e.g. 16")
        check_weights(draft_model, role)
        check_token_id("mask_token_id", mask_token_id, "pass the drafter's mask token's integer id")
        if sep_token_id is not None:
            check_int("sep_token_id", sep_token_id, 0, "pass a token id of the drafter's vocabulary, or None")
        patch = model_patches.get_patch(draft_model)
        mask = patch.mask_token_id(draft_model, mask_token_id)
        if mask is None:
            raise invalid("mask_token_id", None, f"be known for the drafter (model_type "
                          f"`{draft_model.config.model_type}` has none)", "pass mask_token_id=<the drafter's mask id>")
        check_drafter_tokens(draft_model.get_input_embeddings().num_embeddings, mask_token_id=mask,
                             sep_token_id=sep_token_id, stop_ids=stop_token_ids or [], mask_name="mask_token_id")
        self.num_draft_tokens, self.max_length = num_draft_tokens, max_length
        self.stats = BatchStats(1)
        self.drafter = OneStepDrafter(ModelRunner(draft_model, patch, self.stats, batch_size=1), mask,
                                      draft_attention=draft_attention, sep_token_id=sep_token_id,
                                      sep_position=sep_position)
        self.sampler = Sampler(logits_processor if logits_processor is not None else LogitsProcessorList(),
                               do_sample=do_sample, suppress_token_ids=[mask], generator=generator)
        self.seen = 0

    def get_candidates(self, input_ids: torch.LongTensor, **kwargs: Any) -> tuple[torch.LongTensor, torch.Tensor | None]:
        """`input_ids` `(1, L)` plus k drafted tokens, and the drafts' processed log-probabilities `(1, k, V)`.

        transformers' `_speculative_sampling` takes the softmax of the returned scores, which gives back the
        processed draft distribution exactly.

        Raises:
            ValueError: for a batch of more than one row (transformers' assisted decoding runs batch size 1).
        """
        if input_ids.shape[0] != 1:
            raise invalid("input_ids", f"<batch of {input_ids.shape[0]}>", "have one row (transformers' assisted "
                          "decoding runs batch size 1)", "use generate(custom_generate=hf_dllm_spec.custom_generate, "
                          "decoding_strategy='deer', draft_model=...) for batches")
        k = self.num_draft_tokens
        if self.max_length is not None:
            k = min(k, self.max_length - input_ids.shape[1] - 1)
        if k < 1:
            return input_ids, None
        new = input_ids[0, self.seen:]
        self.seen = input_ids.shape[1]
        # The drafter keeps its own device: its logits come back to the target's, where the draw happens.
        probs = self.sampler.probs(self.drafter.draft([new], k).to(input_ids.device))   # (1, k, V)
        tokens, _ = self.sampler.choose(probs)
        return torch.cat([input_ids, tokens], dim=1), probs.log()

    def update_candidate_strategy(self, input_ids: torch.LongTensor, scores: torch.Tensor, num_matches: int) -> None:
        """k stays fixed (DEER drafts a whole block per cycle)."""


def _check_first_parameter_placed(model, name: str) -> None:
    """Refuse a model whose first parameter accelerate offloaded (`model.device` is "meta" while its forward runs
    on the hook's execution device) where transformers' assisted decoding drives it: `_assisted_decoding` and
    `AssistedCandidateGenerator` move the ids to `model.device`, so they would reach the forward as meta tensors
    (a `NotImplementedError` inside torch or accelerate). The library's own loops place inputs on the execution
    device and take such models.

    Raises:
        ValueError: naming `name` ("model", "assistant_model"), with the call that decodes it instead.
    """
    if model.device.type == "meta":
        raise invalid(name, f"<{type(model).__name__} whose first parameter is offloaded (its `.device` is meta)>",
                      "have its first parameter on a real device: transformers' assisted decoding moves the ids to "
                      "`.device`", "decode with generate(custom_generate=hf_dllm_spec.custom_generate, "
                      "decoding_strategy='deer', draft_model=<drafter>), which runs offloaded models on their "
                      "execution device, or keep the input embeddings on a device in the `device_map`")


def is_assistant_call(kwargs: dict[str, Any]) -> bool:
    """Whether a `generate` call comes from transformers' stock assisted decoding (`AssistedCandidateGenerator`
    sets `generation_config.is_assistant`): a stock target's `generate(assistant_model=<diffusion drafter>)`."""
    generation_config = kwargs.get("generation_config")
    return bool(getattr(generation_config, "is_assistant", False))


def draft_as_assistant(draft_model, input_ids: torch.LongTensor, *, generation_config, logits_processor=None,
                       max_new_tokens: int | None = None, **kwargs: Any):
    """A diffusion drafter answering transformers' stock assisted decoding: DEER's one-forward draft (§3.2).

    transformers' `AssistedCandidateGenerator` (what a stock target's `generate(assistant_model=drafter)` builds)
    asks the assistant for `max_new_tokens` tokens with `output_scores=True`, as if it were an AR model. A
    diffusion drafter answers with one forward over `[input_ids | MASK x k]` (k = `max_new_tokens`), the drafts
    chosen from the processed distribution (argmax unless `generation_config.do_sample`), and the processed
    log-probabilities as `scores`; the target verifies them with transformers' own rule (greedy: the target's
    greedy tokens, whatever the drafter; sampling: speculative sampling on the softmax of the scores, which is the
    processed draft distribution). The drafter's prefix is recomputed every cycle (no cache across calls);
    :func:`deer_assisted_generate` keeps it.

    Args:
        draft_model (`PreTrainedModel`): a diffusion LM of a family `model_patches` knows.
        input_ids (`torch.LongTensor` of shape `(1, L)`): the verified prefix.
        generation_config (`GenerationConfig`): the assistant's config (`do_sample`, `max_new_tokens`).
        logits_processor (`LogitsProcessorList`, *optional*): the target's processors, applied to the drafts.
        max_new_tokens (`int`, *optional*): k, default `generation_config.max_new_tokens`.
        kwargs: the assistant's other keywords (`attention_mask`, a cache), unused.

    Returns:
        `GenerateDecoderOnlyOutput`: `sequences` `(1, L + k)` and `scores`, k tensors `(1, V)` (no cache).

    Raises:
        ValueError: what :class:`DeerCandidateGenerator` refuses (a batch of more than one row, a drafter without
            a mask token, ...), named `assistant_model`; a drafter whose first parameter is offloaded.
    """
    from transformers.generation.utils import GenerateDecoderOnlyOutput

    k = max_new_tokens if max_new_tokens is not None else generation_config.max_new_tokens
    drafter = DeerCandidateGenerator(draft_model, num_draft_tokens=max(1, int(k)),
                                     logits_processor=active_processors(logits_processor, input_ids.shape[1]),
                                     do_sample=bool(generation_config.do_sample), role="assistant_model")
    _check_first_parameter_placed(draft_model, "assistant_model")     # once it is known to be loaded
    sequences, logprobs = drafter.get_candidates(input_ids)
    return GenerateDecoderOnlyOutput(sequences=sequences, scores=tuple(logprobs.unbind(1)))


#: The candidate generator factory of the `deer_assisted_generate` call running in this context (thread).
_FACTORY: contextvars.ContextVar[Any] = contextvars.ContextVar("hf_dllm_spec_deer_factory", default=None)
_INSTALL_LOCK = threading.Lock()


class _CandidateDispatch:
    """`model._get_candidate_generator` while DEER calls run on `model`: each call's own factory in its context,
    transformers' own method for any other (another thread's plain `generate(assistant_model=...)`)."""

    def __init__(self, model) -> None:
        self.model, self.users = model, 0

    def __call__(self, *args: Any, **kwargs: Any):
        factory = _FACTORY.get()
        if factory is None:
            return type(self.model)._get_candidate_generator(self.model, *args, **kwargs)
        return factory(*args, **kwargs)


@contextlib.contextmanager
def _candidate_generator(model, factory):
    """Make `model` build its assisted-decoding candidate generator with `factory` in this context only (the
    instance attribute is shared by the calls running on `model` and removed after the last)."""
    token = _FACTORY.set(factory)
    with _INSTALL_LOCK:
        dispatch = vars(model).get("_get_candidate_generator")
        if not isinstance(dispatch, _CandidateDispatch):
            dispatch = model._get_candidate_generator = _CandidateDispatch(model)
        dispatch.users += 1
    try:
        yield
    finally:
        _FACTORY.reset(token)
        with _INSTALL_LOCK:
            dispatch.users -= 1
            if not dispatch.users:
                del model._get_candidate_generator


def deer_assisted_generate(model, input_ids: torch.LongTensor, draft_model, *, num_draft_tokens: int = 32,
                           mask_token_id: int | None = None, draft_attention: str = "causal_prefix",
                           sep_token_id: int | None = None, sep_position: str = "after_masks",
                           generator: torch.Generator | None = None, **generate_kwargs: Any):
    """DEER through transformers' own assisted decoding: `model.generate(input_ids, assistant_model=draft_model)`
    with :class:`DeerCandidateGenerator` as the candidate generator.

    Args:
        model (`PreTrainedModel`): the AR target.
        input_ids (`torch.LongTensor` of shape `(1, P)`): one prompt.
        draft_model (`PreTrainedModel`): the diffusion drafter (same vocabulary).
        num_draft_tokens (`int`, defaults to 32): k.
        mask_token_id, draft_attention, sep_token_id, sep_position, generator: see :class:`DeerCandidateGenerator`.
        **generate_kwargs: passed to `generate` (`max_new_tokens`, `do_sample`, `temperature`, ...).

    Returns:
        What `generate` returns. The generator used is available as `model.last_deer_candidate_generator`
        (its `stats` count the drafter forwards): the last one built on `model`, any thread's when calls run in
        several.

    Raises:
        ValueError: as `generate` and :class:`DeerCandidateGenerator` raise; first of all (before transformers
            validates the pair and would advise an `assistant_tokenizer`, which does not apply) a model on the meta
            device, a target whose first parameter is offloaded (transformers' loop reads `model.device`), a
            target that is no autoregressive causal LM (:func:`~hf_dllm_spec.integration.plan.check_model_kinds`)
            or a drafter of another vocabulary.
    """
    check_weights(model, "model")
    _check_first_parameter_placed(model, "model")
    check_weights(draft_model, "draft_model")
    patch, drafter_patch = model_patches.get_patch(model), model_patches.get_patch(draft_model)
    check_model_kinds(DeerStrategy, model, patch, draft_model, drafter_patch)
    check_vocabulary(model, patch, draft_model, drafter_patch)

    def factory(*, generation_config, logits_processor, input_ids=None, **_: Any) -> DeerCandidateGenerator:
        if input_ids is not None:                       # a length option that masks no position: as in stock
            logits_processor = active_processors(logits_processor, input_ids.shape[1])
        generator_ = DeerCandidateGenerator(
            draft_model, num_draft_tokens=num_draft_tokens, logits_processor=logits_processor,
            do_sample=bool(generation_config.do_sample), max_length=generation_config.max_length,
            mask_token_id=mask_token_id, draft_attention=draft_attention, sep_token_id=sep_token_id,
            sep_position=sep_position, generator=generator,
            stop_token_ids=patch.stop_token_ids(model, generation_config))
        model.last_deer_candidate_generator = generator_
        return generator_

    with _candidate_generator(model, factory):
        return model.generate(input_ids, assistant_model=draft_model, **generate_kwargs)
