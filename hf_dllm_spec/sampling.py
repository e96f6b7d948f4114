"""From logits to per-position distributions, tokens and confidences.

Temperature, top-k, top-p and token suppression are transformers' own `LogitsProcessor` objects, applied
per position: a block's logits `(L, V)` are treated as a batch of `L` independent rows. The same processed
distribution is used for drafting and for verification (speculative sampling, Leviathan et al. 2023 / Chen et
al. 2023: both sides must carry the same transforms for rejection sampling to be lossless).

Only position-independent processors are accepted. Context-dependent ones (repetition penalty, n-gram
blocking, minimum length, forced tokens, grammars) need a left context per position, which is ill-defined
when tokens are committed out of order; they raise `NotImplementedError` instead of being ignored.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import LogitsProcessorList
from transformers.generation.logits_process import (
    EpsilonLogitsWarper,
    EtaLogitsWarper,
    MinPLogitsWarper,
    SequenceBiasLogitsProcessor,
    SuppressTokensLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TypicalLogitsWarper,
)

from .validation import invalid

#: Processors whose output at a position depends on that position's logits alone.
POSITION_INDEPENDENT_PROCESSORS: tuple[type, ...] = (
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    MinPLogitsWarper,
    TypicalLogitsWarper,
    EpsilonLogitsWarper,
    EtaLogitsWarper,
    SuppressTokensLogitsProcessor,
)


#: The `generate` option that makes transformers add each context-dependent processor (for the error message).
_PROCESSOR_OPTIONS = {
    "RepetitionPenaltyLogitsProcessor": "repetition_penalty",
    "EncoderRepetitionPenaltyLogitsProcessor": "encoder_repetition_penalty",
    "NoRepeatNGramLogitsProcessor": "no_repeat_ngram_size",
    "EncoderNoRepeatNGramLogitsProcessor": "encoder_no_repeat_ngram_size",
    "NoBadWordsLogitsProcessor": "bad_words_ids",
    "SequenceBiasLogitsProcessor": "sequence_bias",
    "MinLengthLogitsProcessor": "min_length",
    "MinNewTokensLengthLogitsProcessor": "min_new_tokens",
    "ForcedBOSTokenLogitsProcessor": "forced_bos_token_id",
    "ForcedEOSTokenLogitsProcessor": "forced_eos_token_id",
    "ExponentialDecayLengthPenalty": "exponential_decay_length_penalty",
    "SuppressTokensAtBeginLogitsProcessor": "begin_suppress_tokens",
    "PrefixConstrainedLogitsProcessor": "prefix_allowed_tokens_fn",
    "InfNanRemoveLogitsProcessor": "remove_invalid_values",
    "UnbatchedClassifierFreeGuidanceLogitsProcessor": "guidance_scale",
    "ClassifierFreeGuidanceLogitsProcessor": "guidance_scale",
    "WatermarkLogitsProcessor": "watermarking_config",
}


def _position_independent(proc) -> bool:
    """Exact class match (a user subclass may read `input_ids`, which the sampler cannot supply per position);
    a sequence bias on single tokens only is a fixed per-token bias."""
    if type(proc) in POSITION_INDEPENDENT_PROCESSORS:
        return True
    if type(proc) is SequenceBiasLogitsProcessor:
        return all(len(sequence) == 1 for sequence in proc.sequence_bias)
    return False


def check_logits_processors(processors: LogitsProcessorList | None) -> None:
    """Raise `NotImplementedError` unless every processor depends on each position's logits alone.

    Accepted by exact class: the processors of :data:`POSITION_INDEPENDENT_PROCESSORS` and a
    `SequenceBiasLogitsProcessor` whose sequences are single tokens (what transformers' token healing builds).

    Raises:
        NotImplementedError: naming the `generate` option that added the processor (e.g. `repetition_penalty`),
            or `logits_processor` for a processor passed by the user, and listing the supported ones.
    """
    for proc in processors or []:
        if _position_independent(proc):
            continue
        name = type(proc).__name__
        option = _PROCESSOR_OPTIONS.get(name, "logits_processor") if type(proc).__module__.startswith(
            "transformers.") else "logits_processor"
        supported = ", ".join(c.__name__ for c in POSITION_INDEPENDENT_PROCESSORS)
        raise invalid(option, f"<{name}>", "add only processors that depend on each position's logits alone "
                      "(the context of a position is ill-defined when a diffusion decoder commits tokens out of "
                      f"order; subclasses are refused because they may read `input_ids`). Supported: {supported}",
                      f"drop `{option}`", error=NotImplementedError)


@dataclass
class Sampler:
    """Turns logits into the processed distribution, draws tokens and reports confidences.

    Args:
        logits_processor (`LogitsProcessorList`): transformers processors (warpers only when sampling).
        do_sample (`bool`): sample from the processed distribution (True) or take its argmax (False).
        suppress_token_ids (`list[int]`): ids that get zero probability everywhere (the mask token: a sampled
            MASK would leave the position masked; suppressing it is a documented deviation from the references).
        generator (`torch.Generator` or `None`): the only source of randomness; `None` uses torch's global RNG.
    """

    logits_processor: LogitsProcessorList
    do_sample: bool
    suppress_token_ids: list[int]
    generator: torch.Generator | None = None

    def __post_init__(self) -> None:
        check_logits_processors(self.logits_processor)
        # The suppression SuppressTokensLogitsProcessor would apply, as one `index_fill` (no vocabulary-wide isin).
        self._suppress = torch.tensor(sorted(set(self.suppress_token_ids)), dtype=torch.long)

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """Processed distribution per position.

        Args:
            logits (`torch.Tensor` of shape `(..., V)`, e.g. `(N, B, V)`): raw logits, any float dtype. Every
                position is an independent row for the processors.

        Returns:
            `torch.Tensor` of the same shape, float32: softmax of the processed logits. Called p (draft) or q
            (verifier) in S2D2 Algorithm 3.
        """
        return torch.softmax(self.scores(logits), dim=-1)

    def greedy(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Greedy choice without the full distribution: the argmax of the processed logits and its probability.

        What :meth:`choose` returns on :meth:`probs` when not sampling (up to float rounding of the probability),
        from one max and one log-sum-exp over the vocabulary instead of a softmax written out, an argmax over it
        and a gather; for the steps whose consumers read only the chosen token and its confidence.

        Args:
            logits (`torch.Tensor` of shape `(..., V)`): raw logits, any float dtype.

        Returns:
            `(token_ids, confidence)`: int64 and float32 of shape `(...)`.

        Raises:
            ValueError: when sampling (`do_sample=True`): a draw needs the distribution.
        """
        if self.do_sample:
            raise ValueError("Sampler.greedy: the sampler draws tokens (`do_sample=True`); use probs() + choose().")
        scores = self.scores(logits)
        best, token_ids = scores.max(dim=-1)
        return token_ids, torch.exp(best - torch.logsumexp(scores, dim=-1))

    def scores(self, logits: torch.Tensor) -> torch.Tensor:
        """The processed logits (suppression, then the processors in order), float32, same shape as `logits`."""
        shape = logits.shape
        scores = logits.float().reshape(-1, shape[-1])
        dummy_ids = torch.zeros((scores.shape[0], 1), dtype=torch.long, device=scores.device)
        if self._suppress.numel():
            if self._suppress.device != scores.device:
                self._suppress = self._suppress.to(scores.device)
            scores = scores.index_fill(-1, self._suppress, -float("inf"))
        for proc in self.logits_processor:
            scores = proc(dummy_ids, scores)
        return scores.reshape(shape)

    def choose(self, probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Pick one token per position and report its probability (the confidence).

        Args:
            probs (`torch.Tensor` of shape `(..., V)`, float32): from :meth:`probs`.

        Returns:
            `(token_ids, confidence)`: int64 and float32 of shape `(...)`, the probability of the chosen token
            under `probs`, as in SDAR's `block_diffusion_generate` (greedy: the float32 softmax probability of the
            argmax). Greedy takes the argmax; sampling draws one token per position
            from the generator in row-major order (one `torch.multinomial` call).
        """
        if self.do_sample:
            flat = probs.reshape(-1, probs.shape[-1])
            token_ids = torch.multinomial(flat, 1, generator=self.generator).reshape(probs.shape[:-1])
        else:
            token_ids = probs.argmax(dim=-1)
        return token_ids, probs.gather(-1, token_ids[..., None])[..., 0]


def entropy(probs: torch.Tensor) -> torch.Tensor:
    """Shannon entropy per position in nats.

    Args:
        probs (`torch.Tensor` of shape `(..., V)`).

    Returns:
        `torch.Tensor` of shape `(...)`: -sum_v p log p, with 0 log 0 = 0.
    """
    return -(probs * torch.log(probs.clamp_min(1e-30))).sum(dim=-1)


def top2_margin(probs: torch.Tensor) -> torch.Tensor:
    """Top-1 minus top-2 probability per position, `(..., V) -> (...)` (m_i in S2D2 §4.3)."""
    top = probs.topk(2, dim=-1).values
    return top[..., 0] - top[..., 1]
