"""Feeding a transformers streamer (`BaseStreamer.put` / `end`) with final tokens only.

A diffusion decoder commits tokens out of order; a streamer must only see tokens that will not change and
that the returned sequence will contain. :class:`TokenStream` receives, after each decoding step, the row's
final left-contiguous tokens so far, cuts them with the same function that cuts the returned sequence (budget,
first stop id, stopping criteria) and passes on what is new. `generate` calls the streamer's `end()` once,
whatever happens (:func:`hf_dllm_spec.integration.generate.ending_streamer`).

Drafts: a streamer with `put_draft` (transformers' `TextDiffusionStreamer` protocol) also receives, as `(1, k)`,
the provisional tokens that follow the final ones (the rest of the current block before a step commits, its
undecided positions filled with the model's most likely token; or a drafter's proposals before verification);
each draft replaces the previous one and `put` commits. Strategies send them with :meth:`~hf_dllm_spec.strategies.base.DecodingStrategy.stream_draft`.
"""

from __future__ import annotations

from typing import Callable

import torch


class TokenStream:
    """Forwards new final tokens of one row to a `BaseStreamer` (`put(ids)`, `end()`).

    Args:
        streamer (`BaseStreamer`): e.g. `TextStreamer` or `TextIteratorStreamer`.
        output (`callable`): `(final tokens (n,)) -> (m,)`, the part of them the returned sequence holds; a
            prefix that never shrinks as more final tokens arrive.

    The plan has checked the streamer (batch size 1, no `_takes_logits`) before any forward.

    >>> class Printer:
    ...     def put(self, ids): print(ids.tolist())
    ...     def end(self): print("end")
    >>> stream = TokenStream(Printer(), lambda tokens: tokens[:3])
    >>> stream.push(torch.tensor([5, 6]))
    [5, 6]
    >>> stream.push(torch.tensor([5, 6, 9, 7]))
    [9]
    """

    def __init__(self, streamer, output: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.streamer, self.output = streamer, output
        self.sent = 0
        self.takes_drafts = callable(getattr(streamer, "put_draft", None))

    def push(self, final_tokens: torch.Tensor) -> None:
        """Stream what `final_tokens` `(n,)` (all final tokens of the row so far) adds to what was sent."""
        tokens = self.output(final_tokens)
        if tokens.shape[0] > self.sent:
            self.streamer.put(tokens[self.sent:].cpu())
            self.sent = tokens.shape[0]

    def draft(self, provisional: torch.Tensor) -> None:
        """Show `provisional` `(k,)` (tokens after the final ones that a later step may still change) to a streamer
        with `put_draft`, as `(1, k)`; nothing for other streamers or an empty draft."""
        if self.takes_drafts and provisional.numel():
            self.streamer.put_draft(provisional[None].cpu())
