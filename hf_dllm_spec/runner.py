"""Forwards with an explicit layout over a cache that only grows by what the caller says to store.

`ModelRunner.forward` takes the query tokens, their positions and a bool pattern among them; every query row
also sees every stored token. The first `store_len` query tokens persist (their rows must not see the rest of
the query, so their K/V are final); the rest is read-only: the forward runs with the cache, then the cache is
cropped back (platform.md: "read the cache without extending it").

`use_cache=False` recomputes every forward from the stored tokens with the same per-row visibility the cache
encodes. It is the slow reference the cached path is tested against.
"""

from __future__ import annotations

import torch

from .masks import to_additive, with_cache_prefix
from .outputs import SpecDecodingStats
from .timing import now


class ModelRunner:
    """One model plus its stored context.

    Args:
        model (`PreTrainedModel`): the decoding model, in eval mode.
        patch (`model_patches.FamilyPatch`): its family adapter (runs the forward).
        stats (`SpecDecodingStats`): forward counters to update.
        use_cache (`bool`, defaults to True): keep K/V in a `DynamicCache`; False recomputes.
        cache (`DynamicCache`, *optional*): an empty cache to use (e.g. the one `generate` prepared).

    Raises:
        ValueError: if `cache` is not empty.
    """

    def __init__(self, model, patch, stats: SpecDecodingStats, *, use_cache: bool = True, cache=None) -> None:
        self.model, self.patch, self.stats, self.use_cache = model, patch, stats, use_cache
        self.device = model.device
        self.dtype = model.dtype if model.dtype.is_floating_point else torch.float32
        if use_cache:
            self.cache = cache if cache is not None else patch.new_cache(model)
            if self.cache.get_seq_length() != 0:
                raise ValueError(
                    f"`past_key_values` holds {self.cache.get_seq_length()} tokens; hf_dllm_spec starts from an "
                    "empty cache. Pass the full prompt and no cache."
                )
        self.stored_len = 0
        # No-cache path: the stored tokens and which stored tokens each stored row sees.
        self._ids = torch.empty(0, dtype=torch.long, device=self.device)
        self._pos = torch.empty(0, dtype=torch.long, device=self.device)
        self._visible = torch.empty(0, 0, dtype=torch.bool, device=self.device)

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        intra_mask: torch.Tensor,
        *,
        kind: str,
        store_len: int = 0,
        logits_to_keep: int = 0,
    ) -> torch.Tensor:
        """Run one forward and count it.

        Args:
            input_ids (`torch.Tensor` of shape `(q,)`, int64): query tokens.
            position_ids (`torch.Tensor` of shape `(q,)`, int64): absolute positions (may repeat).
            intra_mask (`torch.Tensor` of shape `(q, q)`, bool): visibility among the query tokens.
            kind (`str`): counter to increment ("prefill", "draft", "verify", "cache_write").
            store_len (`int`, defaults to 0): leading query tokens whose K/V persist.
            logits_to_keep (`int`, defaults to 0): return logits of the last n query rows only (0 = all).

        Returns:
            `torch.Tensor` of shape `(n, V)`, float32 logits.

        Raises:
            ValueError: if a stored row would see a later query token (its K/V would depend on read-only tokens).
        """
        q = input_ids.shape[0]
        if store_len and intra_mask[:store_len, store_len:].any():
            raise ValueError(
                f"ModelRunner.forward: the {store_len} stored query rows must not see the {q - store_len} "
                "read-only rows after them; fix the intra mask."
            )
        self.stats.count_forward(kind)
        t0 = now(self.device)
        if self.use_cache:
            mask = to_additive(with_cache_prefix(intra_mask, self.stored_len), self.dtype)
            logits = self.patch.forward(
                self.model, input_ids[None], position_ids=position_ids[None], attention_mask=mask,
                past_key_values=self.cache, logits_to_keep=logits_to_keep,
            )[0]
            if q - store_len:
                self.cache.crop(-(q - store_len))
        else:
            logits = self._forward_recompute(input_ids, position_ids, intra_mask, logits_to_keep)
            self._append(input_ids[:store_len], position_ids[:store_len], intra_mask[:store_len, :store_len])
        self.stored_len += store_len
        self.stats.forward_time_s += now(self.device) - t0
        return logits

    def _forward_recompute(self, input_ids, position_ids, intra_mask, logits_to_keep) -> torch.Tensor:
        s, q = self.stored_len, input_ids.shape[0]
        full = torch.zeros(s + q, s + q, dtype=torch.bool, device=self.device)
        full[:s, :s] = self._visible
        full[s:] = with_cache_prefix(intra_mask, s)
        logits = self.patch.forward(
            self.model, torch.cat([self._ids, input_ids])[None],
            position_ids=torch.cat([self._pos, position_ids])[None],
            attention_mask=to_additive(full, self.dtype), past_key_values=None,
            logits_to_keep=logits_to_keep or q,
        )[0]
        return logits

    def _append(self, ids: torch.Tensor, pos: torch.Tensor, intra: torch.Tensor) -> None:
        s, n = self.stored_len, ids.shape[0]
        if n == 0:
            return
        visible = torch.zeros(s + n, s + n, dtype=torch.bool, device=self.device)
        visible[:s, :s] = self._visible
        visible[s:] = with_cache_prefix(intra, s)
        self._visible = visible
        self._ids = torch.cat([self._ids, ids])
        self._pos = torch.cat([self._pos, pos])
