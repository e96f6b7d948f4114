"""Mask tricks equal the slow sequential forwards they replace; cached paths equal recomputation (fp32, CPU)."""

from __future__ import annotations

import pytest
import torch
from conftest import MASK_ID, gen

from hf_dllm_spec.maths.masks import causal_mask, partially_causal_draft_mask, verifier_2l_mask
from hf_dllm_spec.outputs import BatchStats
from hf_dllm_spec.strategies.reference import reference_block_diffusion_generate
from hf_dllm_spec.runtime.runner import ModelRunner
from model_patches import get_patch
from model_patches.compat import output_cache

ATOL = dict(atol=1e-5, rtol=1e-5)


def _runner(model, use_cache=True, batch_size=1, cls=ModelRunner):
    return cls(model, get_patch(model), BatchStats(batch_size), batch_size=batch_size, use_cache=use_cache)


class _CompactingRunner(ModelRunner):
    """Compacts as soon as padding outnumbers the real tokens (the production threshold is 64 columns)."""

    COMPACT_MIN_LENGTH = 2


def test_2l_verifier_equals_sequential_block_size_1_forwards(sdar_model):
    """Eq. 3: one 2L forward gives, at every block position r, the block-size-1 prediction given x~_<r."""
    context = torch.tensor([5, 17, 42, 8, 23, 61, 4, 9])
    block = torch.tensor([33, 7, 61, 12])                   # a drafted block (masks filled with drafts)
    start, B = context.shape[0], block.shape[0]
    runner = _runner(sdar_model)
    runner.forward(context[None], torch.arange(start)[None], causal_mask(start), kind="prefill", store_len=start)
    pos = torch.arange(start, start + B)
    ids = torch.cat([block, torch.full_like(block, MASK_ID)])
    verify = runner.forward(ids[None], torch.cat([pos, pos])[None], verifier_2l_mask(B), kind="verify",
                            logits_to_keep=B)
    assert verify.shape == (1, B, sdar_model.config.vocab_size)
    assert runner.cache.get_seq_length() == start            # read-only
    for r in range(B):
        seq_ids = torch.cat([block[:r], torch.tensor([MASK_ID])])
        sequential = runner.forward(seq_ids[None], pos[None, : r + 1], causal_mask(r + 1), kind="verify")[0, -1]
        torch.testing.assert_close(verify[0, r], sequential, **ATOL)
    # and the AR-mode prediction differs from what the block-diffusion draft would see (the test can fail)
    draft = runner.forward(torch.full_like(block, MASK_ID)[None], pos[None], torch.ones(B, B, dtype=torch.bool),
                           kind="draft")
    assert (draft[0, 1] - verify[0, 1]).abs().max() > 1e-3
    assert runner.stats.row(0).num_verify_forwards == 1 + B and runner.stats.row(0).num_draft_forwards == 1


def test_partially_causal_draft_and_ar_cache_give_causal_kv(sdar_model):
    """Eq. 4 + AR-like caching: stored K/V equal a plain causal forward over the same tokens."""
    seq = torch.tensor([5, 17, 42, 8, 23, 61, 4, 9, 33, 7, 61, 12])
    prefix, B, j = 8, 4, 2
    runner = _runner(sdar_model)
    runner.forward(seq[None, :prefix], torch.arange(prefix)[None], causal_mask(prefix), kind="prefill",
                   store_len=prefix)
    block = seq[prefix:].clone()
    block[j:] = MASK_ID
    runner.forward(block[None], torch.arange(prefix, prefix + B)[None], partially_causal_draft_mask(B, torch.tensor([j])),
                   kind="draft", store_len=B)
    out = sdar_model(input_ids=seq[None], use_cache=True)       # stock causal forward
    n = prefix + j
    for ours, ref in zip(runner.cache.layers, output_cache(out).layers):
        torch.testing.assert_close(ours.keys[..., :n, :], ref.keys[..., :n, :], **ATOL)
        torch.testing.assert_close(ours.values[..., :n, :], ref.values[..., :n, :], **ATOL)
    # Without Eq. 4 the decoded prefix sees the masks after it, and its K/V differ from the causal ones.
    runner2 = _runner(sdar_model)
    runner2.forward(seq[None, :prefix], torch.arange(prefix)[None], causal_mask(prefix), kind="prefill",
                    store_len=prefix)
    runner2.forward(block[None], torch.arange(prefix, prefix + B)[None], torch.ones(B, B, dtype=torch.bool),
                    kind="draft", store_len=B)
    assert (runner2.cache.layers[1].values[..., prefix:n, :] - output_cache(out).layers[1].values[..., prefix:n, :]).abs().max() > 1e-4


def test_runner_cache_equals_recompute(sdar_model):
    """Store, read-only and fused forwards through the cache equal the no-cache recomputation."""
    cached, slow = _runner(sdar_model, True), _runner(sdar_model, False)
    steps = [
        (torch.tensor([5, 17, 42, 8]), torch.arange(4), torch.ones(4, 4, dtype=torch.bool), 4),
        (torch.tensor([9, MASK_ID, MASK_ID, 3]), torch.arange(4, 8), torch.ones(4, 4, dtype=torch.bool), 0),
        (torch.tensor([9, 1, 2, 3, MASK_ID, MASK_ID]), torch.tensor([4, 5, 6, 7, 8, 9]),
         torch.tensor([[1, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0], [1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 0, 0],
                       [1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]], dtype=torch.bool), 4),
        (torch.tensor([MASK_ID, 7]), torch.tensor([8, 9]), torch.ones(2, 2, dtype=torch.bool), 0),
    ]
    for ids, pos, intra, store in steps:
        a = cached.forward(ids[None], pos[None], intra, kind="draft", store_len=store)
        b = slow.forward(ids[None], pos[None], intra, kind="draft", store_len=store)
        assert a.shape == (1, ids.shape[0], sdar_model.config.vocab_size)
        torch.testing.assert_close(a, b, **ATOL)
    assert cached.cache.get_seq_length() == cached.stored_len == slow.stored_len == 8


def test_runner_rejects_stored_rows_that_see_read_only_rows(sdar_model):
    with pytest.raises(ValueError, match="must not see"):
        _runner(sdar_model).forward(torch.tensor([[1, 2]]), torch.arange(2)[None], torch.ones(2, 2, dtype=torch.bool),
                                    kind="draft", store_len=1)
    # batched intra mask: one offending row is enough
    intra = torch.ones(2, 2, dtype=torch.bool).tril().expand(3, 2, 2).clone()
    intra[1, 0, 1] = True
    with pytest.raises(ValueError, match="must not see"):
        _runner(sdar_model, batch_size=3).forward(torch.ones(3, 2, dtype=torch.long), torch.arange(2).expand(3, 2),
                                                  intra, kind="draft", store_len=1)


# -- batched runner: rows that store different amounts (left padding) --------------------------------------------
def _b(rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.bool)


def _fused_intra(store: int, read: int, n: int) -> torch.Tensor:
    """(n, s + r, s + r): stored tokens causal among themselves; read-only tokens see everything."""
    q = store + read
    intra = torch.zeros(n, q, q, dtype=torch.bool)
    intra[:, :store, :store] = causal_mask(store)
    intra[:, store:, :] = True
    return intra


M = MASK_ID
# (ids (3, q), positions (3, q), intra, store_len, store_valid or None, logits_to_keep)
BATCHED_STEPS = [
    # prefill: row 0 stores 4 real tokens, row 1 stores 2 real tokens after 2 padding, row 2 stores 4
    (torch.tensor([[5, 17, 42, 8], [77, 66, 9, 3], [11, 12, 13, 14]]),
     torch.tensor([[0, 1, 2, 3], [0, 0, 0, 1], [0, 1, 2, 3]]),
     causal_mask(4), 4, _b([[1, 1, 1, 1], [0, 0, 1, 1], [1, 1, 1, 1]]), 0),
    # read-only draft of a block per row
    (torch.tensor([[M, M, M, M], [M, 7, M, M], [M, M, 2, M]]),
     torch.tensor([[4, 5, 6, 7], [2, 3, 4, 5], [4, 5, 6, 7]]),
     torch.ones(4, 4, dtype=torch.bool), 0, None, 0),
    # fused: row 0 stores 4, row 1 stores 2 after 2 padding, row 2 stores nothing; then 2 read-only tokens
    (torch.tensor([[23, 61, 4, 9, M, M], [50, 51, 33, 7, M, M], [52, 53, 54, 55, M, 8]]),
     torch.tensor([[4, 5, 6, 7, 8, 9], [0, 0, 2, 3, 4, 5], [4, 5, 6, 7, 4, 5]]),
     _fused_intra(4, 2, 3), 4, _b([[1, 1, 1, 1], [0, 0, 1, 1], [0, 0, 0, 0]]), 0),
    # read-only, per-row intra patterns (row 1 causal, rows 0 and 2 full)
    (torch.tensor([[M, M, M, M], [M, M, M, M], [1, M, M, M]]),
     torch.tensor([[8, 9, 10, 11], [4, 5, 6, 7], [4, 5, 6, 7]]),
     torch.stack([torch.ones(4, 4, dtype=torch.bool), causal_mask(4), torch.ones(4, 4, dtype=torch.bool)]),
     0, None, 0),
    # store-only: row 0 stores 1 after 3 padding, rows 1 and 2 store 4
    (torch.tensor([[60, 61, 62, 3], [1, 2, 3, 4], [5, 6, 7, 8]]),
     torch.tensor([[0, 0, 0, 8], [4, 5, 6, 7], [4, 5, 6, 7]]),
     causal_mask(4), 4, _b([[0, 0, 0, 1], [1, 1, 1, 1], [1, 1, 1, 1]]), 0),
    # read-only, last 2 logits only
    (torch.tensor([[M, M, M, 4], [M, 9, M, M], [M, M, M, M]]),
     torch.tensor([[9, 10, 11, 12], [8, 9, 10, 11], [8, 9, 10, 11]]),
     torch.ones(4, 4, dtype=torch.bool), 0, None, 2),
]


def _run_steps(runner, steps):
    out = []
    for ids, pos, intra, store, valid, keep in steps:
        out.append(runner.forward(ids, pos, intra, kind="draft", store_len=store, store_valid=valid,
                                  logits_to_keep=keep))
    return out


def test_runner_batched_cache_equals_recompute_with_padding(sdar_model):
    cached, slow = _runner(sdar_model, True, 3), _runner(sdar_model, False, 3)
    for step, (a, b) in enumerate(zip(_run_steps(cached, BATCHED_STEPS), _run_steps(slow, BATCHED_STEPS))):
        keep = BATCHED_STEPS[step][5] or BATCHED_STEPS[step][0].shape[1]
        assert a.shape == (3, keep, sdar_model.config.vocab_size)
        for n in range(3):
            torch.testing.assert_close(a[n], b[n], **ATOL)
        # the rows are not interchangeable (a mixed-up row would be caught)
        assert (a[0] - a[1]).abs().max() > 1e-3 and (a[1] - a[2]).abs().max() > 1e-3
    assert cached.cache.get_seq_length() == cached.stored_len == slow.stored_len == 12
    assert torch.equal(cached.valid, slow.valid)
    assert cached.valid.sum(dim=1).tolist() == [9, 8, 8]


def test_runner_batched_rows_equal_separate_runners(sdar_model):
    """Each row of the padded batch gives the logits of a batch-1 runner that stored only its real tokens."""
    batched = _run_steps(_runner(sdar_model, True, 3), BATCHED_STEPS)
    for n in range(3):
        single = _runner(sdar_model, True, 1)
        for step, (ids, pos, intra, store, valid, keep) in enumerate(BATCHED_STEPS):
            real = torch.ones(ids.shape[1], dtype=torch.bool)
            if valid is not None:
                real[:store] = valid[n]
            intra_n = (intra if intra.dim() == 2 else intra[n])[real][:, real]
            out = single.forward(ids[n, real][None], pos[n, real][None], intra_n, kind="draft",
                                 store_len=int(real[:store].sum()), logits_to_keep=keep)
            torch.testing.assert_close(out[0, -out.shape[1]:], batched[step][n, -out.shape[1]:], **ATOL)
        assert single.stored_len == [9, 8, 8][n]


def test_runner_padding_is_invisible(sdar_model):
    """A row whose store segment is padding reads exactly what a runner that never stored it reads."""
    pad_ids = torch.tensor([50, 51, 52, 53])
    ref = _runner(sdar_model, True, 1)
    ref.forward(torch.tensor([[9, 3]]), torch.tensor([[0, 1]]), causal_mask(2), kind="prefill", store_len=2)
    ref_a = ref.forward(torch.tensor([[M, 7]]), torch.tensor([[2, 3]]), torch.ones(2, 2, dtype=torch.bool),
                        kind="draft")
    ref_b = ref.forward(torch.tensor([[M, M, 4, M]]), torch.tensor([[2, 3, 4, 5]]),
                        torch.ones(4, 4, dtype=torch.bool), kind="draft")

    def batched(step1_valid, step2_valid, use_cache=True):
        runner = _runner(sdar_model, use_cache, 2)
        runner.forward(torch.tensor([[5, 17, 42, 8], [77, 66, 9, 3]]), torch.tensor([[0, 1, 2, 3], [0, 0, 0, 1]]),
                       causal_mask(4), kind="prefill", store_len=4,
                       store_valid=torch.stack([torch.ones(4, dtype=torch.bool), step1_valid]))
        # fused: row 0 stores a block, row 1's store segment is padding; then 2 read-only tokens per row
        a = runner.forward(torch.stack([torch.tensor([23, 61, 4, 9, M, M]), torch.cat([pad_ids, torch.tensor([M, 7])])]),
                           torch.tensor([[4, 5, 6, 7, 8, 9], [2, 3, 4, 5, 2, 3]]), _fused_intra(4, 2, 2)[0],
                           kind="draft", store_len=4,
                           store_valid=torch.stack([torch.ones(4, dtype=torch.bool), step2_valid]), logits_to_keep=2)
        b = runner.forward(torch.tensor([[M, M, M, M], [M, M, 4, M]]), torch.tensor([[8, 9, 10, 11], [2, 3, 4, 5]]),
                           torch.ones(4, 4, dtype=torch.bool), kind="draft")
        return a[1], b[1]

    pad2, pad4 = _b([0, 0, 1, 1]), torch.zeros(4, dtype=torch.bool)
    for use_cache in (True, False):
        a, b = batched(pad2, pad4, use_cache)
        torch.testing.assert_close(a, ref_a[0], **ATOL)
        torch.testing.assert_close(b, ref_b[0], **ATOL)
    # negative controls: the same tokens marked real change the row's logits
    a, b = batched(torch.ones(4, dtype=torch.bool), pad4)
    assert (a - ref_a[0]).abs().max() > 1e-3 and (b - ref_b[0]).abs().max() > 1e-3
    a, b = batched(pad2, torch.ones(4, dtype=torch.bool))
    assert (a - ref_a[0]).abs().max() > 1e-3 and (b - ref_b[0]).abs().max() > 1e-3


@pytest.mark.parametrize("use_cache", [True, False])
def test_runner_select_rows_keeps_remaining_rows(sdar_model, use_cache):
    full = _runner(sdar_model, use_cache, 3)
    sel = _runner(sdar_model, use_cache, 3)
    head = BATCHED_STEPS[:3]
    for a, b in zip(_run_steps(full, head), _run_steps(sel, head)):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
    index = torch.tensor([2, 0])                                # drop row 1, reorder the rest
    sel.select_rows(index)
    sel.stats.select(index.tolist())
    assert sel.batch_size == 2 and sel.stored_len == full.stored_len
    if use_cache:
        assert sel.cache.layers[0].keys.shape[0] == 2
    # the remaining rows read the same logits as before, in the new order ...
    for ids, pos, intra, store, valid, keep in BATCHED_STEPS[3:]:
        sub_intra = intra if intra.dim() == 2 else intra[index]
        sub_valid = None if valid is None else valid[index]
        a = full.forward(ids, pos, intra, kind="draft", store_len=store, store_valid=valid, logits_to_keep=keep)
        b = sel.forward(ids[index], pos[index], sub_intra, kind="draft", store_len=store, store_valid=sub_valid,
                        logits_to_keep=keep)
        assert b.shape[0] == 2
        torch.testing.assert_close(b, a[index], **ATOL)
        assert (b[0] - b[1]).abs().max() > 1e-3                # a swapped order would be caught
    # ... and the per-row counters follow the rows
    assert sel.stats.row(0) is sel.stats.per_row[2] and sel.stats.row(1) is sel.stats.per_row[0]
    assert sel.stats.per_row[1].num_draft_forwards == 3 and sel.stats.per_row[0].num_draft_forwards == 6


@pytest.mark.parametrize("use_cache", [True, False])
def test_runner_compaction_keeps_logits(sdar_model, use_cache):
    """Rows storing in turn (the others pad) leave mostly padding; compacting it changes no logits."""
    plain, compact = _runner(sdar_model, use_cache, 3), _runner(sdar_model, use_cache, 3, cls=_CompactingRunner)
    ref = _runner(sdar_model, True, 3)
    g = torch.Generator().manual_seed(0)
    length = torch.zeros(3, dtype=torch.long)
    for turn in range(9):                                     # the check doubles: compaction at 16 columns
        row = turn % 3
        valid = torch.zeros(3, 2, dtype=torch.bool)
        valid[row] = True
        ids = torch.randint(0, 90, (3, 2), generator=g)
        pos = torch.stack([torch.arange(int(length[r]), int(length[r]) + 2) if r == row else torch.zeros(2, dtype=torch.long)
                           for r in range(3)])
        length[row] += 2
        read_ids = torch.randint(0, 90, (3, 3), generator=g)
        read_ids[:, 0] = MASK_ID
        read_pos = length[:, None] + torch.arange(3)
        for runner in (plain, compact, ref):
            runner.forward(ids, pos, causal_mask(2), kind="cache_write", store_len=2, store_valid=valid)
        outs = [r.forward(read_ids, read_pos, torch.ones(3, 3, dtype=torch.bool), kind="draft")
                for r in (plain, compact, ref)]
        torch.testing.assert_close(outs[1], outs[0], **ATOL)
        torch.testing.assert_close(outs[1], outs[2], **ATOL)
    assert plain.stored_len == 18 and compact.stored_len == 8         # 16 columns compacted to 6, then 2 more
    assert compact.valid.sum(dim=1).tolist() == plain.valid.sum(dim=1).tolist() == [6, 6, 6]
    if use_cache:
        assert compact.cache.get_seq_length() == compact.stored_len


GREEDY = dict(eos_token_id=None, do_sample=False, return_dict_in_generate=True)


@pytest.mark.parametrize("block_size,rule", [(1, "low_confidence_static"), (4, "low_confidence_static"),
                                             (4, "sequential"), (8, "low_confidence_dynamic")])
def test_block_diffusion_equals_reference_and_recompute(sdar_model, prompt, block_size, rule):
    kwargs = dict(GREEDY, max_new_tokens=12, block_size=block_size, remasking_strategy=rule,
                  confidence_threshold=0.3)
    strategy = "ar" if block_size == 1 else "block_diffusion"
    if strategy == "ar":
        kwargs.pop("block_size")
    fused = sdar_model.generate(prompt, decoding_strategy=strategy, **kwargs)
    unfused = sdar_model.generate(prompt, decoding_strategy=strategy, fuse_cache_write=False, **kwargs)
    no_cache = sdar_model.generate(prompt, decoding_strategy=strategy, use_cache=False, **kwargs)
    ref = reference_block_diffusion_generate(sdar_model, prompt[0], mask_token_id=MASK_ID, block_size=block_size,
                                             max_new_tokens=12, remasking_strategy=rule, confidence_threshold=0.3)
    assert fused.sequences[0, prompt.shape[1]:].tolist() == ref[:12].tolist()
    assert torch.equal(fused.sequences, unfused.sequences) and torch.equal(fused.sequences, no_cache.sequences)
    blocks = -(-(prompt.shape[1] % block_size + 12) // block_size) if block_size > 1 else 12
    f, u = fused.spec_stats, unfused.spec_stats
    assert f.num_cache_write_forwards == 0 and u.num_cache_write_forwards == blocks
    assert u.nfe - f.nfe == blocks
    if block_size == 1:
        assert f.nfe == 1 + 12                                # one prefill + one forward per token


def test_s2d2_cached_equals_recompute_with_sampling(sdar_model, prompt):
    kwargs = dict(eos_token_id=None, do_sample=True, top_k=0, temperature=1.0, max_new_tokens=16, block_size=8,
                  return_dict_in_generate=True, do_verify_policy="mask_span_length", min_ssd_span_length=2)
    a = sdar_model.generate(prompt, decoding_strategy="s2d2", generator=gen(3), **kwargs)
    b = sdar_model.generate(prompt, decoding_strategy="s2d2", generator=gen(3), use_cache=False, **kwargs)
    c = sdar_model.generate(prompt, decoding_strategy="s2d2", generator=gen(3), fuse_cache_write=False, **kwargs)
    assert torch.equal(a.sequences, b.sequences) and torch.equal(a.sequences, c.sequences)
    assert a.spec_stats.num_verify_forwards > 0


def test_s2d2_greedy_always_verify_with_ar_caching_equals_ar(sdar_model, prompt):
    """Always-on verification + greedy match + cache_ver + draft_ver reproduces AR greedy token for token."""
    common = dict(eos_token_id=None, do_sample=False, max_new_tokens=16)
    ar = sdar_model.generate(prompt, decoding_strategy="ar", **common)
    for block_size in (4, 8):
        s2d2 = sdar_model.generate(prompt, decoding_strategy="s2d2", block_size=block_size, min_ssd_span_length=1,
                                   s2d2_acceptance="greedy_match", cache_ver=True, draft_ver=True, **common)
        assert s2d2.tolist() == ar.tolist()
    # Without AR-like caching the cache is block-causal, and the output is allowed to differ: sanity that the
    # comparison above is not trivially true for every configuration is covered by the 2L test.


def test_same_seed_same_tokens_and_seeds_vary(sdar_model, prompt):
    kwargs = dict(eos_token_id=None, do_sample=True, top_k=0, max_new_tokens=12, block_size=4,
                  s2d2_acceptance="stochastic")
    outs = [sdar_model.generate(prompt, decoding_strategy="s2d2", generator=gen(s), **kwargs) for s in (1, 1, 2, 3)]
    assert torch.equal(outs[0], outs[1])
    assert not (torch.equal(outs[0], outs[2]) and torch.equal(outs[0], outs[3]))
    greedy = [sdar_model.generate(prompt, decoding_strategy="s2d2", generator=gen(s), eos_token_id=None,
                                  max_new_tokens=12, block_size=4) for s in (1, 2)]
    assert torch.equal(greedy[0], greedy[1])             # temperature 0: deterministic regardless of seed
