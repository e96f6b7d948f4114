"""Decoding statistics and the `generate` output (every counter is defined in :class:`SpecDecodingStats`)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field, fields

import torch

from transformers.generation.utils import GenerateDecoderOnlyOutput

FORWARD_KINDS = ("prefill", "draft", "verify", "cache_write")


@dataclass
class SpecDecodingStats:
    """Counters of one `generate` call, for one prompt (or summed over the rows of a batch).

    Forward counters (number of forward passes of the decoding model):
        num_prefill_forwards: over prompt tokens before decoding.
        num_draft_forwards: denoising (drafting) forwards. For the block-diffusion baselines and AR these are
            all decoding forwards; a fused forward that also stores the previous block counts here once.
        num_verify_forwards: S2D2 verifier forwards (the 2L layout).
        num_cache_write_forwards: forwards whose only purpose is to store a finished block's K/V (the unfused
            path; the fused path has none).

    Token counters (in tokens):
        num_generated_tokens: tokens returned after trimming (up to and including the first stop id, at most
            `max_new_tokens`).
        num_committed_tokens: tokens committed by decoding steps (whole blocks, before trimming); equals
            ``num_fallback_tokens + num_accepted_tokens + num_recovered_tokens + num_bonus_tokens`` and
            ``num_generated_tokens + num_discarded_tokens``.
        num_discarded_tokens: committed tokens cut off after the first stop id or past `max_new_tokens`
            (the rest of the last block).
        num_fallback_tokens: committed by the confidence rule (every token of the baselines).
        num_drafts: verification cycles with at least one draft token.
        num_draft_tokens: drafted tokens submitted to verification.
        num_accepted_tokens: drafts that passed.
        num_recovered_tokens: tokens drawn from the residual (or the argmax correction) after a rejection.
        num_bonus_tokens: tokens drawn from the target after full acceptance (none for S2D2).
        num_accepted_tokens_per_pos: accepted count by 0-based draft index within a cycle.
        num_drafts_reaching_pos: cycles whose draft had a token at that index.
        accepted_length_histogram: cycles by number of accepted drafts.
        num_denoising_steps: denoising steps (one draft forward each).

        num_edited_tokens: committed tokens re-decided by a token-editing rule (LLaDA2.1 T2T); they are
            not counted again in ``num_committed_tokens``.

    Batch (for one row, the forwards that served it; summed over rows by :meth:`merge`):
        num_forward_calls: model forward calls actually run. For one prompt it equals `nfe`; for a batch,
            where one call serves every row, the batch's `spec_stats` holds the number of batched calls.
        num_draft_model_forwards: of those, forwards of the separate drafter model (SimSD, DEER), prefill included;
            the target ran the rest.

    Time (seconds): wall_time_s: the whole decoding call (after a device synchronise); prefill_time_s: the
        prefill forward; forward_time_s: all model forwards together (CUDA events, read once at the end: no
        device sync per forward), the rest of `wall_time_s` is the loop's own work: sampling, routing,
        bookkeeping; draft_model_time_s: the separate drafter's share of `forward_time_s` (SimSD, DEER; the
        target's share is the rest); warmup_time_s: the static runtime's one-time work inside the call (CUDA-graph
        capture, the first compiled calls; 0 when nothing was captured or compiled). For a batch every row reports
        the call's times.

    runtime: which runtime ran each model and why compilation is off, if it is, and whether the decoding steps ran
        whole (forward and maths in one compiled function or CUDA graph) or the forwards alone (e.g.
        ``"target: eager"``, ``"target: static cache, cuda_graph, whole steps"``, ``"target: static cache,
        cuda_graph, whole steps; drafter: static cache, eager (bitsandbytes weights)"``).
    """

    num_prefill_forwards: int = 0
    num_draft_forwards: int = 0
    num_verify_forwards: int = 0
    num_cache_write_forwards: int = 0
    num_generated_tokens: int = 0
    num_committed_tokens: int = 0
    num_discarded_tokens: int = 0
    num_fallback_tokens: int = 0
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_recovered_tokens: int = 0
    num_bonus_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)
    num_drafts_reaching_pos: list[int] = field(default_factory=list)
    accepted_length_histogram: Counter = field(default_factory=Counter)
    num_denoising_steps: int = 0
    num_edited_tokens: int = 0
    num_forward_calls: int = 0
    num_draft_model_forwards: int = 0
    wall_time_s: float = 0.0
    prefill_time_s: float = 0.0
    forward_time_s: float = 0.0
    draft_model_time_s: float = 0.0
    warmup_time_s: float = 0.0
    runtime: str = ""

    def count_forward(self, kind: str, draft_model: bool = False) -> None:
        """Add one forward of `kind` (one of :data:`FORWARD_KINDS`); `draft_model`: run by the separate drafter."""
        if kind not in FORWARD_KINDS:
            raise ValueError(f"SpecDecodingStats.count_forward: `kind` (={kind!r}) must be one of {FORWARD_KINDS}.")
        name = f"num_{kind}_forwards"
        setattr(self, name, getattr(self, name) + 1)
        self.num_forward_calls += 1
        self.num_draft_model_forwards += int(draft_model)

    def record_output(self, num_tokens: int) -> None:
        """The row returned `num_tokens` tokens: `num_generated_tokens`, and the committed tokens beyond them
        (after its stop or past its budget) as `num_discarded_tokens`."""
        self.num_generated_tokens = num_tokens
        self.num_discarded_tokens = self.num_committed_tokens - num_tokens

    def observe_verification(self, num_draft_tokens: int, num_accepted: int, recovered: bool, bonus: bool) -> None:
        """Record one verification cycle (vLLM `observe_draft` analogue)."""
        if num_draft_tokens == 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        self.num_recovered_tokens += int(recovered)
        self.num_bonus_tokens += int(bonus)
        self.accepted_length_histogram[num_accepted] += 1
        for counter in (self.num_accepted_tokens_per_pos, self.num_drafts_reaching_pos):
            counter.extend([0] * (num_draft_tokens - len(counter)))
        for pos in range(num_draft_tokens):
            self.num_drafts_reaching_pos[pos] += 1
            if pos < num_accepted:
                self.num_accepted_tokens_per_pos[pos] += 1

    def merge(self, other: "SpecDecodingStats") -> "SpecDecodingStats":
        """Add `other`'s counters and times into this object (aggregating several calls); returns self."""
        for f in fields(self):
            mine, theirs = getattr(self, f.name), getattr(other, f.name)
            if isinstance(mine, list):
                mine.extend([0] * (len(theirs) - len(mine)))
                for i, value in enumerate(theirs):
                    mine[i] += value
            elif isinstance(mine, Counter):
                mine.update(theirs)
            elif isinstance(mine, str):          # a description: kept once, different ones joined
                setattr(self, f.name, "; ".join(dict.fromkeys(v for v in (mine, theirs) if v)))
            else:
                setattr(self, f.name, mine + theirs)
        return self

    @property
    def nfe(self) -> int:
        """Number of forward passes, all kinds (S2D2 convention)."""
        return (
            self.num_prefill_forwards + self.num_draft_forwards + self.num_verify_forwards
            + self.num_cache_write_forwards
        )

    @property
    def edit_rate(self) -> float:
        """Token edits (LLaDA2.1 T2T) per committed token, ``num_edited_tokens / num_committed_tokens`` (0 if none)."""
        return self.num_edited_tokens / self.num_committed_tokens if self.num_committed_tokens else 0.0

    @property
    def decode_forwards(self) -> int:
        """Forwards after prefill: ``nfe - num_prefill_forwards``."""
        return self.nfe - self.num_prefill_forwards

    @property
    def tpf(self) -> float:
        """Tokens per forward (TPF, as in the LLaDA2.1 report): generated tokens / forwards after prefill."""
        return self.num_generated_tokens / self.decode_forwards if self.decode_forwards else 0.0

    @property
    def acceptance_rate(self) -> float:
        """alpha = accepted drafts / drafted tokens submitted to verification; nan with no verification."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else float("nan")

    @property
    def mean_accepted_per_draft(self) -> float:
        """Accepted drafts per verification cycle, without the recovered/bonus token (DEER's tau)."""
        return self.num_accepted_tokens / self.num_drafts if self.num_drafts else float("nan")

    @property
    def mean_acceptance_length(self) -> float:
        """tau = (accepted + recovered + bonus) / cycles: includes the target-sampled token (vLLM convention)."""
        emitted = self.num_accepted_tokens + self.num_recovered_tokens + self.num_bonus_tokens
        return emitted / self.num_drafts if self.num_drafts else float("nan")

    @property
    def per_position_acceptance_rate(self) -> list[float]:
        """Accepted / cycles reaching each draft index."""
        return [a / n if n else float("nan")
                for a, n in zip(self.num_accepted_tokens_per_pos, self.num_drafts_reaching_pos)]

    @property
    def verify_rate(self) -> float:
        """Verifier forwards per denoising step (S2D2 routing activity)."""
        return self.num_verify_forwards / self.num_denoising_steps if self.num_denoising_steps else 0.0

    @property
    def draft_target_time_ratio(self) -> float:
        """rho = T_draft / T_target, the time of one drafter forward over one target forward (SimSD §3.3 Eq. 3),
        from the measured forward times and counts; nan without both kinds of forward."""
        drafter, target = self.num_draft_model_forwards, self.num_forward_calls - self.num_draft_model_forwards
        target_time = self.forward_time_s - self.draft_model_time_s
        if not drafter or not target or target_time <= 0:
            return float("nan")
        return (self.draft_model_time_s / drafter) / (target_time / target)

    @property
    def decode_time_s(self) -> float:
        """Wall time without prefill, in seconds."""
        return self.wall_time_s - self.prefill_time_s

    @property
    def overhead_fraction(self) -> float:
        """Share of the wall time spent outside model forwards, in [0, 1]."""
        return 1.0 - self.forward_time_s / self.wall_time_s if self.wall_time_s else 0.0

    def to_dict(self) -> dict:
        """Plain counters plus the derived metrics, for logs and tables."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["accepted_length_histogram"] = dict(sorted(self.accepted_length_histogram.items()))
        for name in ("nfe", "tpf", "acceptance_rate", "mean_accepted_per_draft", "mean_acceptance_length",
                     "verify_rate", "draft_target_time_ratio", "decode_time_s", "overhead_fraction"):
            out[name] = getattr(self, name)
        return out


class BatchStats:
    """Per-row `SpecDecodingStats` of a batched call, addressed by the row's current index in the batch.

    Rows leave the batch when they finish (:meth:`select`); their counters stay. `count_forward` adds one
    forward of a kind to the rows it served and one to the batch's count of forward calls. Counters computed on
    the device are added with :meth:`accumulate` and stay there until a row leaves or :meth:`total` is read, so
    the decoding loop does not wait on the device to count.

    Args:
        batch_size (`int`): N, the number of prompts.
    """

    def __init__(self, batch_size: int) -> None:
        self.per_row = [SpecDecodingStats() for _ in range(batch_size)]
        self.active = list(range(batch_size))         # batch index -> prompt index
        self.num_forward_calls = 0
        self.num_draft_model_forwards = 0
        self._pending: dict[str, list] = {}

    def row(self, index: int) -> SpecDecodingStats:
        """Counters of the row at batch index `index`."""
        return self.per_row[self.active[index]]

    def count_forward(self, kind: str, rows=None, draft_model: bool = False) -> None:
        """One forward of `kind` for the rows where `rows` (`(N,)` bools, a list or a tensor) is true; all if None.

        `draft_model`: the forward ran the separate drafter model (counted in `num_draft_model_forwards` too)."""
        self.num_forward_calls += 1
        self.num_draft_model_forwards += int(draft_model)
        flags = [True] * len(self.active) if rows is None else (rows.tolist() if hasattr(rows, "tolist") else rows)
        for r, flag in zip(self.active, flags):
            if flag:
                self.per_row[r].count_forward(kind, draft_model)

    def accumulate(self, name: str, values: "torch.Tensor", rows: "torch.Tensor | None" = None) -> None:
        """Add device-side per-row values to counter `name`; no device work until :meth:`flush`.

        Args:
            name (`str`): a `SpecDecodingStats` field: an integer counter, a per-position list
                (`num_accepted_tokens_per_pos`, `num_drafts_reaching_pos`) or `accepted_length_histogram`.
            values (`torch.Tensor` of shape `(M,)`, or `(M, K)` for a list (index k) or the histogram (bin k)).
            rows (`torch.Tensor` of shape `(M,)`, int64, *optional*): the batch rows `values` belong to; all rows
                (M = N) when omitted.
        """
        self._pending.setdefault(name, []).append((rows, values))

    def observe_verification(self, rows: "torch.Tensor", num_draft_tokens: "torch.Tensor",
                             num_accepted: "torch.Tensor", recovered: "torch.Tensor", bonus: "torch.Tensor",
                             width: int | None = None) -> None:
        """Record one verification cycle for each of `rows` (vLLM `observe_draft` analogue, batched).

        Args:
            rows (`torch.Tensor` of shape `(M,)`, int64): batch rows that verified.
            num_draft_tokens, num_accepted (`torch.Tensor` of shape `(M,)`, int64): drafts submitted / passed.
            recovered, bonus (`torch.Tensor` of shape `(M,)`, bool): the extra committed token's origin.
            width (`int`, *optional*): `num_draft_tokens.max()` when the caller knows it on the host (else read
                from the device: one synchronisation).
        """
        drafted = num_draft_tokens > 0
        if width is None:
            width = int(num_draft_tokens.max()) if num_draft_tokens.numel() else 0
        positions = torch.arange(max(width, 1), device=rows.device)[None]
        self.accumulate("num_drafts", drafted, rows)
        self.accumulate("num_draft_tokens", num_draft_tokens, rows)
        self.accumulate("num_accepted_tokens", num_accepted, rows)
        self.accumulate("num_recovered_tokens", recovered, rows)
        self.accumulate("num_bonus_tokens", bonus, rows)
        bins = torch.arange(width + 1, device=rows.device)[None]                # 0 .. width accepted drafts
        self.accumulate("accepted_length_histogram", (bins == num_accepted[:, None]) & drafted[:, None], rows)
        self.accumulate("num_accepted_tokens_per_pos", positions < num_accepted[:, None], rows)
        self.accumulate("num_drafts_reaching_pos", positions < num_draft_tokens[:, None], rows)

    def flush(self) -> None:
        """Move the device-side counters into the per-row stats (one host sync per counter; each counter's entries
        are summed in one `index_add_`, whatever their number)."""
        n = len(self.active)
        every_row = None
        for name, entries in self._pending.items():
            device = entries[0][1].device
            width = max(v.shape[1] if v.dim() == 2 else 0 for _, v in entries)
            if every_row is None and any(rows is None for rows, _ in entries):
                every_row = torch.arange(n, device=device)
            rows = torch.cat([every_row if rows is None else rows for rows, _ in entries])
            values = torch.cat([v if not width or v.shape[1] == width else torch.nn.functional.pad(
                v, (0, width - v.shape[1])) for _, v in entries]).long()
            total = torch.zeros((n, width) if width else (n,), dtype=torch.long, device=device)
            total.index_add_(0, rows, values)
            for r, row in zip(self.active, total.tolist()):
                stats = self.per_row[r]
                if isinstance(row, int):
                    setattr(stats, name, getattr(stats, name) + row)
                elif name == "accepted_length_histogram":
                    stats.accepted_length_histogram.update({k: c for k, c in enumerate(row) if c})
                else:
                    counter = getattr(stats, name)
                    counter.extend([0] * (_last_nonzero(row) - len(counter)))
                    for k in range(len(counter)):
                        counter[k] += row[k] if k < len(row) else 0
        for stats in self.per_row:   # both per-position lists span every draft index reached
            width = len(stats.num_drafts_reaching_pos)
            stats.num_accepted_tokens_per_pos.extend([0] * (width - len(stats.num_accepted_tokens_per_pos)))
        self._pending = {}

    def select(self, index: list[int]) -> None:
        """Keep the rows at batch indices `index`, in that order (flushes device-side counters first)."""
        self.flush()
        self.active = [self.active[i] for i in index]

    def add_rows(self, count: int) -> list[int]:
        """Append `count` rows that join the batch (continuous batching), each a new prompt with fresh counters;
        return their prompt indices (flushes device-side counters first: their rows are the batch's before)."""
        self.flush()
        first = len(self.per_row)
        self.per_row.extend(SpecDecodingStats() for _ in range(count))
        self.active.extend(range(first, first + count))
        return list(range(first, first + count))

    def total(self) -> SpecDecodingStats:
        """Counters summed over the rows; `num_forward_calls` and the times are the batch's own."""
        self.flush()
        merged = SpecDecodingStats()
        for stats in self.per_row:
            merged.merge(stats)
        merged.num_forward_calls = self.num_forward_calls
        merged.num_draft_model_forwards = self.num_draft_model_forwards
        if self.per_row:
            first = self.per_row[0]
            merged.wall_time_s, merged.prefill_time_s = first.wall_time_s, first.prefill_time_s
            merged.forward_time_s, merged.draft_model_time_s = first.forward_time_s, first.draft_model_time_s
            merged.warmup_time_s, merged.runtime = first.warmup_time_s, first.runtime
        return merged


def _last_nonzero(row: list[int]) -> int:
    nonzero = [k for k, c in enumerate(row) if c]
    return nonzero[-1] + 1 if nonzero else 0


@dataclass
class GenerateDllmOutput(GenerateDecoderOnlyOutput):
    """`GenerateDecoderOnlyOutput` plus the decoding statistics, returned with `return_dict_in_generate=True`.

    Attributes:
        sequences (`torch.LongTensor` of shape `(N, prompt_len + max_n)`): the (left-padded) prompts, then each
            row's new tokens, right-padded with `pad_token_id` to the longest row (transformers' layout).
        spec_stats (`SpecDecodingStats`): counters summed over the rows; `num_forward_calls` and the times are
            the batch's own.
        spec_stats_per_row (`list[SpecDecodingStats]`): one per prompt, as if it had been decoded alone.
    """

    spec_stats: SpecDecodingStats | None = None
    spec_stats_per_row: list[SpecDecodingStats] | None = None
