"""Forwards with an explicit layout over a batched cache that only grows by what the caller says to store.

`ModelRunner.forward` takes the query tokens of `N` rows, their positions and a bool pattern among them. The
first `store_len` query tokens persist (their rows must not see the rest of the query, so their K/V are final);
the rest is read-only: the forward runs with the cache, then the cache is cropped back (transformers 5.x
`DynamicCache.crop(-k)` drops the last k tokens; :func:`model_patches.compat.crop`).

Rows store different amounts (different prompt lengths, blocks finishing at different steps, different
accepted lengths), yet the cache has one length `T` for the whole batch. Each row therefore carries a validity
mask over the stored columns, `valid` `(N, T)`: a row that has nothing to store in a forward stores padding
(``store_valid`` False, always on the left of the stored segment), which no query ever sees. The exactness of
the cache is then a property of the mask, not of per-row crops. When padding outweighs the real tokens the
runner compacts the cache (a per-row gather of the valid columns; RoPE is already applied to the stored keys,
so moving columns changes nothing).

Alignment is data: the runner returns logits aligned to the positions they predict. "position" families
(SDAR, LLaDA2) predict position i at row i. "right_shift" families (Fast-dLLM v2, every AR model) predict
position i at row i - 1; the runner shifts, and a query token whose predecessor is not in the query (the first
token after the cache, or after padding) takes the logits the last stored token produced when it was stored
(the "carry", one `(V,)` vector per row).

`use_cache=False` recomputes every forward from the stored tokens with the same per-row visibility the cache
encodes. It is the slow reference the cached path is tested against.
"""

from __future__ import annotations

import contextlib

import torch

from model_patches.compat import CACHE_KWARG, crop

from ..maths.masks import to_additive
from ..outputs import BatchStats
from .weights import execution_device
from .timing import ForwardTimer
from .trace import ForwardRecord, active_trace


#: The `timer_span` of a separate drafter model: its forwards are timed and counted apart (`draft_model_time_s`,
#: `num_draft_model_forwards`).
DRAFT_MODEL_SPAN = "draft_model"


def _grown(tensor: torch.Tensor, rows: int, front: int, columns: tuple[int, ...]) -> torch.Tensor:
    """`tensor` with `rows` zero rows appended (dimension 0) and `front` zero columns put in front along each of the
    dimensions `columns`."""
    shape, index = list(tensor.shape), [slice(0, tensor.shape[0])] + [slice(None)] * (tensor.dim() - 1)
    shape[0] += rows
    for dim in columns:
        shape[dim] += front
        index[dim] = slice(front, None)
    out = tensor.new_zeros(shape)
    out[tuple(index)] = tensor
    return out


class _JoiningStats:
    """The counters of a runner that stores the prompts of joining rows alone: its forwards count for those rows
    (the batch rows `first ..` of `stats`) and once for the batch."""

    def __init__(self, stats: BatchStats, first: int) -> None:
        self.stats, self.first = stats, first

    def count_forward(self, kind: str, rows=None, draft_model: bool = False) -> None:
        flags = [True] * (len(self.stats.active) - self.first) if rows is None else \
            (rows.tolist() if hasattr(rows, "tolist") else list(rows))
        self.stats.count_forward(kind, [False] * self.first + flags, draft_model)


def align_right_shift(raw: torch.Tensor, query_valid: torch.Tensor | None, q: int, keep: int, s: int,
                      carry: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A right-shifted model's logits aligned to the tokens they predict (a pure function of tensors).

    The logits at query row i - 1 predict query token i; a kept token without a valid query predecessor (the
    query's first token, or one after padding) takes the carry, the logits of the row's last stored token.

    Args:
        raw (`torch.Tensor` of shape `(N, keep_raw, V)`): the model's logits of the last `keep_raw` query rows.
        query_valid (`torch.Tensor` of shape `(N, q)`, bool, *optional*): real query tokens (None: all).
        q (`int`), keep (`int`): the query's tokens and the logits to return (of its last `keep` tokens).
        s (`int`): the query's first `s` tokens are stored; the last stored real token's logits become the carry.
        carry (`torch.Tensor` of shape `(N, V)`, *optional*): the carry before the query (None: zeros).

    Returns:
        `(aligned, carry)`: `(N, keep, V)` logits, and the carry after the query (`carry` itself when `s` is 0).

    Source: Fast-dLLM v2 (the first token of each block from the last logit of the previous block's cache
    write); the AR convention of transformers' `generate` (logits at position t predict token t + 1).
    """
    n, keep_raw, vocab = raw.shape
    if query_valid is None:
        query_valid = torch.ones(n, q, dtype=torch.bool, device=raw.device)
    offset = q - keep_raw                                      # query index of raw[:, 0]
    before = carry if carry is not None else raw.new_zeros(n, vocab)
    prev = torch.arange(q - keep, q, device=raw.device) - 1    # predecessor query index of each kept token
    prev_valid = query_valid[:, prev.clamp(min=0)] & (prev >= 0)         # no boolean index: no host read
    shifted = raw[:, (prev - offset).clamp(min=0)]
    aligned = torch.where(prev_valid[..., None], shifted, before[:, None, :])
    if s:
        stored_any = query_valid[:, :s].any(dim=1)
        carry = torch.where(stored_any[:, None], raw[:, s - 1 - offset], before)
    return aligned, carry


class ModelRunner:
    """One model, its family adapter and its stored context, for a batch of `N` rows.

    Args:
        model (`PreTrainedModel`): the model, in eval mode.
        patch (`model_patches.FamilyPatch`): its family adapter (runs the forward, states the alignment).
        stats (`BatchStats`): per-row forward counters to update.
        batch_size (`int`): N.
        use_cache (`bool`, defaults to True): keep K/V in a `DynamicCache`; False recomputes.
        cache (`DynamicCache`, *optional*): an empty cache to use (e.g. the one `generate` prepared).
        timer (`ForwardTimer`, *optional*): times every forward under "forward" (no device sync), and under
            `timer_span` as well when given.
        timer_span (`str`, *optional*): a second span name for this model's forwards; :data:`DRAFT_MODEL_SPAN`
            ("draft_model") marks the separate drafter (its time and forwards are reported apart).

    Raises:
        ValueError: if `cache` is not empty.

    >>> runner = ModelRunner(model, get_patch(model), BatchStats(1), batch_size=1)     # doctest: +SKIP
    >>> logits = runner.forward(ids, pos, causal_mask(4), kind="prefill", store_len=4)  # doctest: +SKIP
    """

    #: Compact once the cache is at least this long and padding columns outnumber the longest row's tokens.
    COMPACT_MIN_LENGTH = 64
    #: Check every layout (stored rows blind to read-only rows, padding first); costs a host sync per storing
    #: forward, so it is off by default and on in the test suite (vLLM's `strict_mode`).
    check_layouts: bool = False
    #: What runs this model's forwards, reported in `SpecDecodingStats.runtime` (the static runtime says more).
    runtime_note: str = "eager"

    def __init__(self, model, patch, stats: BatchStats, *, batch_size: int, use_cache: bool = True, cache=None,
                 timer: ForwardTimer | None = None, timer_span: str | None = None) -> None:
        self.model, self.patch, self.stats, self.use_cache = model, patch, stats, use_cache
        self.timer_span = timer_span
        self.alignment = patch.alignment_of(model)
        self.device = execution_device(model)                     # not `model.device` (meta when offloaded)
        self.dtype = model.dtype if model.dtype.is_floating_point else torch.float32     # per model: its masks
        self.timer = timer if timer is not None else ForwardTimer(self.device)
        if use_cache:
            self.cache = cache if cache is not None else patch.new_cache(model)
            if self.cache.get_seq_length() != 0:
                raise ValueError(
                    f"`{CACHE_KWARG}` holds {self.cache.get_seq_length()} tokens; hf_dllm_spec starts from an "
                    "empty cache. Pass the full prompt and no cache."
                )
        n = batch_size
        self.valid = torch.zeros(n, 0, dtype=torch.bool, device=self.device)     # (N, T)
        self.carry: torch.Tensor | None = None                                     # (N, V), right_shift only
        self._next_compact_check = self.COMPACT_MIN_LENGTH
        # No-cache path: the stored tokens and which stored tokens each stored row sees.
        self._ids = torch.empty(n, 0, dtype=torch.long, device=self.device)
        self._pos = torch.empty(n, 0, dtype=torch.long, device=self.device)
        self._visible = torch.empty(n, 0, 0, dtype=torch.bool, device=self.device)

    @property
    def stored_len(self) -> int:
        """T, the common number of stored columns (padding included)."""
        return self.valid.shape[1]

    @property
    def batch_size(self) -> int:
        """N, the rows in the batch now (`int`; changed by :meth:`select_rows` and :meth:`add_rows`)."""
        return self.valid.shape[0]

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        intra_mask: torch.Tensor,
        *,
        kind: str,
        store_len: int = 0,
        store_valid: torch.Tensor | None = None,
        logits_to_keep: int = 0,
        rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Run one forward for the whole batch and count it for `rows`.

        Args:
            input_ids (`torch.Tensor` of shape `(N, q)`, int64): query tokens.
            position_ids (`torch.Tensor` of shape `(N, q)`, int64): absolute positions (may repeat).
            intra_mask (`torch.Tensor` of shape `(q, q)` or `(N, q, q)`, bool): visibility among the query tokens.
            kind (`str`): counter to increment ("prefill", "draft", "verify", "cache_write").
            store_len (`int`, defaults to 0): leading query tokens whose K/V persist.
            store_valid (`torch.Tensor` of shape `(N, store_len)`, bool, *optional*): which stored tokens are real
                per row; padding must come first in each row. All real when omitted.
            logits_to_keep (`int`, defaults to 0): return logits for the last n query tokens only (0 = all).
            rows (`torch.Tensor` of shape `(N,)`, bool, *optional*): rows this forward serves, for the per-row
                counters (all rows when omitted).

        Returns:
            `torch.Tensor` of shape `(N, n, V)`, float32 logits; entry i predicts the token at the position of
            query token q - n + i, whatever the family's alignment.

        Raises:
            ValueError: if a stored row would see a later query token (its K/V would depend on read-only tokens).
        """
        n, q = input_ids.shape
        s = store_len
        intra, query_valid, keep, keep_raw = self._prepare_query(n, q, intra_mask, s, store_valid, logits_to_keep)
        self.stats.count_forward(kind, rows, draft_model=self.timer_span == DRAFT_MODEL_SPAN)
        self._maybe_compact()
        with self.timer.span("forward"), self._own_span(), self._traced(kind, n, q, s, keep_raw):
            if self.use_cache:
                mask = torch.cat([self.valid[:, None, :].expand(n, q, -1), intra], dim=-1)
                raw = self.patch.forward(
                    self.model, input_ids, position_ids=position_ids, attention_mask=to_additive(mask, self.dtype),
                    cache=self.cache, logits_to_keep=keep_raw,
                )
                if q - s:
                    crop(self.cache, q - s)
            else:
                raw = self._forward_recompute(input_ids, position_ids, intra, keep_raw)
                self._append(input_ids[:, :s], position_ids[:, :s], intra[:, :s, :s])
        if s:
            stored = query_valid[:, :s] if query_valid is not None else torch.ones(n, s, dtype=torch.bool,
                                                                                     device=self.device)
            self.valid = torch.cat([self.valid, stored], dim=1)
        if self.alignment == "position":
            return raw[:, -keep:]
        return self._align_right_shift(raw, query_valid, q, keep, s)

    def _prepare_query(self, n: int, q: int, intra_mask: torch.Tensor, s: int, store_valid: torch.Tensor | None,
                       logits_to_keep: int) -> tuple[torch.Tensor, torch.Tensor | None, int, int]:
        """What every runtime does with a query before its forward (see :meth:`forward` for the arguments).

        Returns:
            `(intra, query_valid, keep, keep_raw)`: the `(N, q, q)` pattern with query padding seen by itself only;
            the `(N, q)` bool validity of the query tokens (None: no padding); the logits returned; the logits the
            model computes (one more on right-shifted families, and the last stored token's, the carry).

        Raises:
            ValueError: with `check_layouts`, if a stored row would see a later query token.
        """
        intra = intra_mask.expand(n, q, q) if intra_mask.dim() == 2 else intra_mask
        if self.check_layouts and s:
            self._check_layout(intra, s, store_valid)
        query_valid = None                                        # (N, q) bool; None = no padding in the query
        if store_valid is not None:
            query_valid = torch.ones(n, q, dtype=torch.bool, device=self.device)
            query_valid[:, :s] = store_valid
            # Padding is seen by nobody but itself (a row with no visible key would be ill-defined).
            intra = (intra & query_valid[:, None, :]) | torch.eye(q, dtype=torch.bool, device=self.device)
        keep = logits_to_keep or q
        return intra, query_valid, keep, self.logits_computed(q, keep, s)

    def logits_computed(self, q: int, keep: int, s: int) -> int:
        """The logits a forward of `q` query tokens (the first `s` stored) computes to return `keep`: `keep` on a
        position-aligned model; on a right-shifted one also the predecessor of the first kept token and the last
        stored token's (the carry)."""
        if self.alignment == "position":
            return keep
        keep_raw = min(q, keep + 1)
        return max(keep_raw, q - s + 1) if s else keep_raw

    def _own_span(self):
        return self.timer.span(self.timer_span) if self.timer_span else contextlib.nullcontext()

    def _traced(self, kind: str, rows: int, width: int, stored: int, keep: int):
        """Record this forward in the active :func:`hf_dllm_spec.runtime.trace.trace_forwards` block, if any."""
        trace = active_trace()
        if trace is None:
            return contextlib.nullcontext()
        role = "drafter" if self.timer_span == DRAFT_MODEL_SPAN else "target"
        record = ForwardRecord(role, kind, rows, width, stored, self.stored_len if self.use_cache else 0, keep)
        return trace.forward(record, self.device)

    def discard_tail(self, num_discard: torch.Tensor, carry: torch.Tensor | None = None) -> None:
        """Forget the last `num_discard[n]` stored tokens of each row (the rejected drafts of a verification).

        The AR verification pattern (transformers `_assisted_decoding`): one forward stores the pending token
        and all drafts, then the rejected tail goes. Columns every row discards are cropped from the cache
        (`DynamicCache.crop(-k)`); the rest become padding of their row (`valid` False), which no query sees, so
        the cache of each row equals a fresh prefill of its committed tokens.

        Args:
            num_discard (`torch.Tensor` of shape `(N,)`, int64): tokens to drop per row, each <= the tokens the row
                stored in the last forward.
            carry (`torch.Tensor` of shape `(N, V)`, *optional*): right-shifted models: the logits of each row's
                last kept token (the carry must describe the last stored token); required for them.

        Raises:
            ValueError: if a right-shifted model gets no `carry`.
        """
        if self.alignment != "position" and carry is None:
            raise ValueError("ModelRunner.discard_tail: a right-shifted model needs `carry`, the logits of each "
                             "row's last kept token.")
        common = int(num_discard.min()) if num_discard.numel() else 0
        if common:
            if self.use_cache:
                crop(self.cache, common)
            self.valid = self.valid[:, :-common]
            self._ids, self._pos = self._ids[:, :self.stored_len], self._pos[:, :self.stored_len]
            self._visible = self._visible[:, :self.stored_len, :self.stored_len]
        rest = (num_discard - common).to(self.device)
        columns = torch.arange(self.stored_len, device=self.device)[None]
        self.valid = self.valid & (columns < (self.stored_len - rest)[:, None])
        if carry is not None:
            self.carry = carry

    @staticmethod
    def _check_layout(intra: torch.Tensor, s: int, store_valid: torch.Tensor | None) -> None:
        """Raise `ValueError` if stored rows see read-only rows, or padding follows a real stored token."""
        q = intra.shape[-1]
        if bool(intra[:, :s, s:].any()):
            raise ValueError(
                f"ModelRunner.forward: the {s} stored query rows must not see the {q - s} read-only rows after "
                "them; fix the intra mask."
            )
        if store_valid is not None and bool((store_valid[:, :-1] & ~store_valid[:, 1:]).any()):
            raise ValueError("ModelRunner.forward: `store_valid` must put a row's padding before its real tokens "
                             "(left padding); the right-shift carry reads the last stored token.")

    def _align_right_shift(self, raw: torch.Tensor, query_valid: torch.Tensor | None, q: int, keep: int,
                           s: int) -> torch.Tensor:
        """:func:`align_right_shift` with the runner's carry (updated when the query stored tokens)."""
        aligned, self.carry = align_right_shift(raw, query_valid, q, keep, s, self.carry)
        return aligned

    # -- batch membership ---------------------------------------------------------------------------------------
    def select_rows(self, index: torch.Tensor) -> None:
        """Keep only the rows `index` `(M,)` int64, in that order (finished rows stop costing compute); `index`
        may live on any device (each cache layer reads it on its own: a `device_map` may spread the layers)."""
        index = index.to(self.device)
        if self.use_cache:
            for layer in self.cache.layers:
                keys = getattr(layer, "keys", None)
                if keys is None:                     # never written: the next storing forward sizes it
                    continue
                rows = index.to(keys.device)
                if keys.shape[-2] == 0:
                    # A read-only forward sized this layer for every row and the crop left it without columns;
                    # transformers' `batch_select_indices` skips a layer of length 0, so the next storing forward
                    # would append M rows to N. Its (empty) rows are selected here.
                    layer.keys, layer.values = keys[rows], layer.values[rows]
                else:
                    layer.batch_select_indices(rows)
        self.valid = self.valid[index]
        if self.carry is not None:
            self.carry = self.carry[index]
        self._ids, self._pos, self._visible = self._ids[index], self._pos[index], self._visible[index]

    def add_rows(self, count: int) -> None:
        """Append `count` empty rows (continuous batching: requests that join the running batch). They have no
        stored token (every column is padding to them) and no carry; :meth:`store_joining_rows` stores their
        prompts."""
        if count > 0:
            self._grow(rows=count)

    def store_joining_rows(self, first: int, store) -> None:
        """Store the prompts of the rows `first ..` that joined the batch (:meth:`add_rows`), without computing the
        other rows: `store(runner)` runs the storing forwards on a fresh eager runner of those rows alone (its
        forwards counted for them), whose stored columns then move into their rows here (right-aligned; the
        other rows get padding columns where they are shorter, which no query sees).

        Args:
            first (`int`): the first joining row; the rows from it to the end joined and hold nothing yet.
            store (`callable`): `(ModelRunner) -> None`, the storing forwards (e.g. a prefill).
        """
        rows = self.batch_size - first
        temp = ModelRunner(self.model, self.patch, _JoiningStats(self.stats, first), batch_size=rows,
                           use_cache=self.use_cache, timer=self.timer, timer_span=self.timer_span)
        store(temp)
        if temp.carry is not None:
            if self.carry is None:
                self.carry = temp.carry.new_zeros(self.batch_size, temp.carry.shape[1])
            self.carry[first:] = temp.carry
        if temp.stored_len:
            self._absorb(first, temp)

    def _absorb(self, first: int, temp: "ModelRunner") -> None:
        """Move the columns `temp` (rows `first ..`, nothing stored here yet) stored into those rows."""
        width = temp.stored_len
        extra = width - self.stored_len
        if extra > 0:                                  # every row gets padding columns in front
            self._grow(front=extra)
        if self.use_cache:
            for layer, joined in zip(self.cache.layers, temp.cache.layers):
                if getattr(joined, "keys", None) is None or joined.keys.numel() == 0:
                    continue
                if getattr(layer, "keys", None) is None or layer.keys.numel() == 0:
                    layer.lazy_initialization(joined.keys, joined.values)
                    layer.keys = joined.keys.new_zeros(self.batch_size, *joined.keys.shape[1:2], self.stored_len,
                                                       joined.keys.shape[-1])
                    layer.values = joined.values.new_zeros(layer.keys.shape[:3] + joined.values.shape[-1:])
                layer.keys[first:, :, -width:] = joined.keys
                layer.values[first:, :, -width:] = joined.values
        else:
            self._ids[first:, -width:], self._pos[first:, -width:] = temp._ids, temp._pos
            self._visible[first:, -width:, -width:] = temp._visible
        self.valid[first:, -width:] = temp.valid

    def _grow(self, rows: int = 0, front: int = 0) -> None:
        """Append `rows` empty rows and put `front` padding columns in front of every row's stored columns (no query
        sees them): the cache, the validity mask, the carry and the no-cache path's stored tokens."""
        if self.use_cache:
            for layer in self.cache.layers:
                if getattr(layer, "keys", None) is None:     # never written: the next storing forward sizes it
                    continue
                layer.keys = _grown(layer.keys, rows, front, (2,))
                layer.values = _grown(layer.values, rows, front, (2,))
        self.valid = _grown(self.valid, rows, front, (1,))
        if self.carry is not None:
            self.carry = _grown(self.carry, rows, 0, ())
        stored = 0 if self.use_cache else front        # the no-cache path's stored tokens (none with a cache)
        self._ids, self._pos = _grown(self._ids, rows, stored, (1,)), _grown(self._pos, rows, stored, (1,))
        self._visible = _grown(self._visible, rows, stored, (1, 2))

    def _maybe_compact(self) -> None:
        """Drop padding columns once they outnumber the longest row's real tokens (one host sync, rarely)."""
        length = self.stored_len
        if length < self._next_compact_check:
            return
        longest = int(self.valid.sum(dim=1).max()) if self.batch_size else 0
        if length - longest > longest:
            order = self.valid.long().argsort(dim=1, stable=True)[:, length - longest:]      # (N, longest)
            if self.use_cache:
                for layer in self.cache.layers:
                    if getattr(layer, "keys", None) is None or layer.keys.numel() == 0:
                        continue
                    idx = order.to(layer.keys.device)[:, None, :, None].expand(-1, layer.keys.shape[1], -1,
                                                                               layer.keys.shape[-1])
                    layer.keys, layer.values = layer.keys.gather(2, idx), layer.values.gather(2, idx)
            else:
                self._ids, self._pos = self._ids.gather(1, order), self._pos.gather(1, order)
                rows = self._visible.gather(1, order[:, :, None].expand(-1, -1, length))
                self._visible = rows.gather(2, order[:, None, :].expand(-1, longest, -1))
            self.valid = self.valid.gather(1, order)
            length = longest
        self._next_compact_check = max(self.COMPACT_MIN_LENGTH, 2 * length)

    # -- no-cache reference path ---------------------------------------------------------------------------------
    def _forward_recompute(self, input_ids, position_ids, intra, keep_raw) -> torch.Tensor:
        n, t, q = input_ids.shape[0], self.stored_len, input_ids.shape[1]
        full = torch.zeros(n, t + q, t + q, dtype=torch.bool, device=self.device)
        full[:, :t, :t] = self._visible
        full[:, t:, :t] = self.valid[:, None, :]
        full[:, t:, t:] = intra
        return self.patch.forward(
            self.model, torch.cat([self._ids, input_ids], dim=1),
            position_ids=torch.cat([self._pos, position_ids], dim=1),
            attention_mask=to_additive(full, self.dtype), cache=None, logits_to_keep=keep_raw,
        )

    def _append(self, ids: torch.Tensor, pos: torch.Tensor, intra: torch.Tensor) -> None:
        n, t, s = ids.shape[0], self.stored_len, ids.shape[1]
        if s == 0:
            return
        visible = torch.zeros(n, t + s, t + s, dtype=torch.bool, device=self.device)
        visible[:, :t, :t] = self._visible
        visible[:, t:, :t] = self.valid[:, None, :]
        visible[:, t:, t:] = intra
        self._visible = visible
        self._ids = torch.cat([self._ids, ids], dim=1)
        self._pos = torch.cat([self._pos, pos], dim=1)
