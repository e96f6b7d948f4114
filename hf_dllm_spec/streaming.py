"""Feeding a transformers streamer with final tokens only (ecosystem.md §4).

A diffusion decoder commits tokens out of order; a streamer must only see tokens that will not change and
that the returned sequence will contain. :class:`TokenStream` receives, after each decoding step, the row's
final left-contiguous tokens so far and passes on what is new, cut exactly as the returned sequence is cut
(at `max_new_tokens`, after the first stop id, where a stopping criterion fires). `generate` calls the
streamer's `end()` once, whatever happens.
"""

from __future__ import annotations

import torch


class TokenStream:
    """Forwards new final tokens of one row to a `BaseStreamer` (`put(ids)`, `end()`).

    Args:
        streamer (`BaseStreamer`): e.g. `TextStreamer` or `TextIteratorStreamer`.
        max_new_tokens (`int`): the budget; later tokens are never streamed.
        stop_token_ids (`list[int]`): nothing after the first of them is streamed (the stop id itself is).
        stop_length (`callable`, *optional*): `(final tokens (n,)) -> int | None`, where the caller's stopping
            criteria cut the row (nothing after it is streamed).

    >>> class Printer:
    ...     def put(self, ids): print(ids.tolist())
    ...     def end(self): print("end")
    >>> stream = TokenStream(Printer(), max_new_tokens=4, stop_token_ids=[9])
    >>> stream.push(torch.tensor([5, 6]))
    [5, 6]
    >>> stream.push(torch.tensor([5, 6, 9, 7]))
    [9]
    """

    def __init__(self, streamer, *, max_new_tokens: int, stop_token_ids: list[int], stop_length=None) -> None:
        self.streamer, self.max_new_tokens, self.stop_token_ids = streamer, max_new_tokens, stop_token_ids
        self.stop_length = stop_length
        self.sent = 0
        self.closed = False

    def push(self, final_tokens: torch.Tensor) -> None:
        """Stream what `final_tokens` `(n,)` (all final tokens of the row so far) adds to what was sent."""
        if self.closed:
            return
        tokens = final_tokens[: self.max_new_tokens]
        if self.stop_token_ids:
            hits = torch.isin(tokens, torch.tensor(self.stop_token_ids, device=tokens.device)).nonzero()
            if hits.numel():
                tokens = tokens[: int(hits[0, 0]) + 1]
                self.closed = True
        if self.stop_length is not None:
            cut = self.stop_length(tokens)
            if cut is not None:
                tokens = tokens[:cut]
                self.closed = True
        if tokens.shape[0] > self.sent:
            self.streamer.put(tokens[self.sent:].cpu())
            self.sent = tokens.shape[0]
