"""The training objectives of `recipes.train` against slow, explicit computations of the same losses."""

from __future__ import annotations

import json
import pathlib
import re
from types import SimpleNamespace

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from model_patches.fast_dllm_v2 import Fast_dLLM_QwenConfig, Fast_dLLM_QwenForCausalLM
from recipes.objectives import (EOS_ID, AutoregressiveObjective, BlockDiffusionObjective, D2AObjective,
                                FastDLLMV2Objective, bd_training_mask, cut_at_continuation_edges, d2a_training_mask,
                                packed_windows_mask, random_segments)

SMALL = dict(vocab_size=40, hidden_size=32, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, initializer_range=0.2, tie_word_embeddings=True, attn_implementation="sdpa")


def _packed(allowed: torch.Tensor, row: torch.Tensor) -> torch.Tensor:
    """`allowed` `(2L, 2L)` with each noisy position kept from the noisy copies of later documents of `row` `(L,)` in
    its block (a document ends with its EOS): the explicit form of `packed_windows_mask`."""
    document = torch.cat([torch.zeros(1, dtype=torch.long), (row == EOS_ID).long().cumsum(0)[:-1]])
    seq_len = row.shape[0]
    allowed = allowed.clone()
    for i in range(seq_len):
        for j in range(seq_len):
            if document[j] > document[i]:
                allowed[i, j] = False
    return allowed


def test_bd_training_mask_regions():
    mask = bd_training_mask(6, 2)                                  # (12, 12): [noisy | clean]
    blk = torch.arange(6) // 2
    for i in range(6):
        for j in range(6):
            assert bool(mask[i, j]) == bool(blk[i] == blk[j])           # noisy sees its own noisy block
            assert bool(mask[i, 6 + j]) == bool(blk[j] < blk[i])        # and strictly earlier clean blocks
            assert not bool(mask[6 + i, j])                             # clean never sees noisy
            assert bool(mask[6 + i, 6 + j]) == bool(blk[j] <= blk[i])   # clean is block-causal


def test_packed_windows_hide_a_later_document_from_the_noisy_block():
    """A window `a a EOS | q ...` whose answer ends inside a block: the noisy answer no longer sees the next problem's
    clean question in its block (at inference those positions are masks); the next document still sees the earlier
    one, and the clean copy and the noisy-to-clean part are the block-diffusion mask's."""
    x = torch.tensor([[5, 6, 0, 7, 8, 9, 0, 4]])                  # documents: 0-2, 3-6, 7
    base = bd_training_mask(8, 4)[None, None]
    mask = packed_windows_mask(base, x)[0, 0]
    expected = base[0, 0].clone()
    for i, j in [(0, 3), (1, 3), (2, 3), (4, 7), (5, 7), (6, 7)]:  # noisy i, noisy j of a later document, same block
        assert expected[i, j]
        expected[i, j] = False
    assert torch.equal(mask, expected)


def test_ar_loss_is_next_token_cross_entropy_on_targets():
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(**SMALL)).eval()
    x = torch.randint(3, 40, (2, 12))
    maskable = torch.rand(2, 12) < 0.6
    loss = AutoregressiveObjective(SimpleNamespace()).loss(model, x, maskable, torch.Generator())
    labels = x.masked_fill(~maskable, -100)                        # HF shifts labels itself
    assert torch.allclose(loss, model(input_ids=x, labels=labels).loss, atol=1e-6)
    # a batch of context tokens only (short windows inside a question): no target, no loss (it was NaN, and the
    # logged moving average stayed NaN for the rest of the run)
    none = AutoregressiveObjective(SimpleNamespace()).loss(model, x, torch.zeros_like(maskable), torch.Generator())
    assert none.item() == 0.0


def _block_diffusion_case(objective, model, seed: int):
    """Two windows of 8 tokens (an EOS inside the second block of 4, two question tokens), the objective's loss on
    them with `seed`, and its first draws recomputed: `(x, maskable, loss, gen, t, noise)`, `gen` at the next
    draw."""
    objective.block_sizes = {4: 1.0}
    b, seq_len = 2, 8
    x = torch.randint(3, 40, (b, seq_len))
    x[:, 5] = EOS_ID                                                # a document ends inside the second block
    maskable = torch.ones(b, seq_len, dtype=torch.bool)
    maskable[:, :2] = False
    loss = objective.loss(model, x, maskable, torch.Generator().manual_seed(seed))
    gen = torch.Generator().manual_seed(seed)                       # the same draws, explicitly
    t = torch.rand(b, generator=gen) * (1 - 1e-3) + 1e-3
    noise = (torch.rand(b, seq_len, generator=gen) < t[:, None]) & maskable
    return x, maskable, loss, gen, t, noise


def _noisy_logits(model, noisy: torch.Tensor, clean: torch.Tensor) -> torch.Tensor:
    """Logits `(L, V)` of the noisy half of one explicit `[noisy | clean]` forward under the packed block-diffusion
    mask (blocks of 4)."""
    seq_len = clean.shape[0]
    allowed = _packed(bd_training_mask(seq_len, 4), clean)
    additive = torch.zeros(2 * seq_len, 2 * seq_len).masked_fill(~allowed, torch.finfo(torch.float32).min)
    return model(input_ids=torch.cat([noisy, clean])[None], position_ids=torch.arange(seq_len).repeat(2)[None],
                 attention_mask=additive[None, None]).logits[0]


def test_block_diffusion_loss_equals_explicit_masked_loss():
    """SDAR's loss: cross-entropy at masked positions weighted 1/t, over the maskable count, each row's noisy block
    seeing only its own document's noisy tokens (an EOS inside a block ends a document)."""
    from model_patches.sdar import SDARConfig, SDARForCausalLM

    torch.manual_seed(0)
    model = SDARForCausalLM(SDARConfig(head_dim=8, block_size=4, **SMALL)).eval()
    x, maskable, loss, _, t, noise = _block_diffusion_case(BlockDiffusionObjective(SimpleNamespace()), model, 0)
    assert noise[:, 4:6].any() and noise[:, 6:].any()               # both documents of the block are noisy
    total = torch.tensor(0.0)
    for row in range(x.shape[0]):
        logits = _noisy_logits(model, torch.where(noise[row], torch.tensor(2), x[row]), x[row])
        for i in range(x.shape[1]):
            if noise[row, i]:
                total = total + torch.nn.functional.cross_entropy(logits[i][None], x[row, i][None]) / t[row]
    assert torch.allclose(loss, total / maskable.sum(), atol=1e-5)


def test_fast_dllm_v2_loss_equals_explicit_complementary_loss():
    """Complementary copies mask every target exactly once; row i - 1 of the noisy copy predicts token i."""
    torch.manual_seed(0)
    model = Fast_dLLM_QwenForCausalLM(Fast_dLLM_QwenConfig(bd_size=4, **SMALL)).eval()
    objective = FastDLLMV2Objective(SimpleNamespace(bd_size=4))
    objective.mask_id = 39
    b, seq_len = 2, 8
    x = torch.randint(3, 39, (b, seq_len))
    x[:, 5] = EOS_ID                                               # a document ends inside the second block
    maskable = torch.ones(b, seq_len, dtype=torch.bool)
    maskable[:, :3] = False                                        # a question: never masked, never a target
    loss = objective.loss(model, x, maskable, torch.Generator().manual_seed(5))

    gen = torch.Generator().manual_seed(5)                         # the same draws, explicitly
    t = torch.rand(b, 2, generator=gen) * (1 - 1e-3) + 1e-3
    draw = torch.rand(b, seq_len, generator=gen) < t.repeat_interleave(4, dim=1)
    losses, count = [], 0
    for noise in (draw & maskable, ~draw & maskable):
        for row in range(b):
            noisy = torch.where(noise[row], torch.tensor(39), x[row])
            allowed = _packed(bd_training_mask(seq_len, 4), x[row])
            additive = torch.zeros(2 * seq_len, 2 * seq_len).masked_fill(~allowed, torch.finfo(torch.float32).min)
            logits = model(input_ids=torch.cat([noisy, x[row]])[None],
                           position_ids=torch.arange(seq_len).repeat(2)[None],
                           attention_mask=additive[None, None]).logits[0]
            for i in range(1, seq_len):
                if noise[row, i]:
                    losses.append(torch.nn.functional.cross_entropy(logits[i - 1][None], x[row, i][None]))
                    count += 1
    assert bool(((draw & maskable) ^ (~draw & maskable) == maskable).all())   # each target masked exactly once
    assert torch.allclose(loss, torch.stack(losses).mean(), atol=1e-5)


def test_d2a_training_mask_regions():
    segment = torch.tensor([[0, 0, 1, 1, 1, 2]])
    mask = d2a_training_mask(segment)[0]                           # (12, 12): [noisy | clean]
    seg = segment[0]
    for i in range(6):
        for j in range(6):
            assert bool(mask[i, j]) == bool(seg[i] == seg[j])         # a noisy segment sees itself in full
            assert bool(mask[i, 6 + j]) == bool(seg[j] < seg[i])      # and the clean prefix before it
            assert not bool(mask[6 + i, j])                           # clean never sees noisy
            assert bool(mask[6 + i, 6 + j]) == (j <= i)               # clean is token-causal (the verified prefix)


def test_random_segments_cover_every_position_in_order():
    gen = torch.Generator().manual_seed(0)
    fixed = random_segments(3, 20, 4, gen, fixed=4)
    variable = random_segments(3, 50, 7, gen)
    for seg, longest in ((fixed, 4), (variable, 7)):
        assert (seg[:, 0] == 0).all() and ((seg[:, 1:] - seg[:, :-1]) >= 0).all()
        assert ((seg[:, 1:] - seg[:, :-1]) <= 1).all()
        for row in seg:
            assert torch.bincount(row).max() <= longest


def test_segments_are_cut_where_a_continuation_starts_or_ends():
    """No segment holds prompt and continuation tokens together (a masked answer token saw the next example's
    prompt in its own segment, which tells where the answer ends); every cut of the input segments is kept."""
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        segment = random_segments(3, 40, 9, gen)
        maskable = torch.rand(3, 40, generator=gen) < 0.6
        cut = cut_at_continuation_edges(segment, maskable)
        steps = cut[:, 1:] - cut[:, :-1]
        assert (cut[:, 0] == 0).all() and ((steps == 0) | (steps == 1)).all()
        same = cut[:, 1:] == cut[:, :-1]
        assert not (same & (maskable[:, 1:] != maskable[:, :-1])).any()
        assert not (same & (segment[:, 1:] != segment[:, :-1])).any()


_PROMPTS_AND_ANSWERS = torch.tensor([[0, 0, 1, 1, 1, 1, 0, 0, 0, 1, 1, 1],
                                     [1, 1, 1, 0, 0, 1, 1, 1, 1, 1, 0, 1]], dtype=torch.bool)


@pytest.mark.parametrize("maskable", [torch.ones(2, 12, dtype=torch.bool), _PROMPTS_AND_ANSWERS],
                         ids=["continuations only", "packed prompts and answers"])
def test_d2a_stage2_loss_equals_separate_inference_layout_forwards(maskable):
    """The packed Stage II loss equals, segment by segment, the drafter's inference forward over
    `[clean prefix (causal) | MASK x R (full)]` with weights alpha^(R - i): the mask trick replaces them exactly,
    also in a window that packs several prompts and answers (a masked answer token never sees a later token)."""
    from model_patches.sdar import SDARConfig, SDARForCausalLM

    torch.manual_seed(0)
    model = SDARForCausalLM(SDARConfig(block_size=4, mask_token_id=2, head_dim=8, **SMALL)).eval()
    args = SimpleNamespace(d2a_stage=2, d2a_max_refine=5, d2a_alpha=1.3)
    b, seq_len = 2, 12
    x = torch.randint(3, 40, (b, seq_len))
    loss = D2AObjective(args).loss(model, x, maskable, torch.Generator().manual_seed(4))

    segment = cut_at_continuation_edges(random_segments(b, seq_len, 5, torch.Generator().manual_seed(4)), maskable)
    total = 0.0
    for row in range(b):
        for s_id in segment[row].unique().tolist():
            if not maskable[row][segment[row] == s_id].any():
                continue                                           # a prompt: context only
            cols = (segment[row] == s_id).nonzero()[:, 0]
            start, length = int(cols[0]), cols.numel()
            ids = torch.cat([x[row, :start], torch.full((length,), 2)])
            allowed = torch.ones(start + length, start + length, dtype=torch.bool).tril()
            allowed[start:, :] = True
            additive = torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)
            logits = model(input_ids=ids[None], position_ids=torch.arange(start + length)[None],
                           attention_mask=additive[None, None]).logits[0, start:]
            ce = torch.nn.functional.cross_entropy(logits, x[row, start:start + length], reduction="none")
            weights = 1.3 ** (length - torch.arange(1, length + 1).float())
            total = total + (ce * weights).sum()
    torch.testing.assert_close(loss, total / maskable.sum(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("settings,words", [
    (dict(d2a_alpha=-1.0), "--d2a-alpha (=-1.0) must be > 0"),
    (dict(d2a_alpha=float("nan")), "--d2a-alpha (=nan) must be > 0"),
    (dict(d2a_max_refine=0), "--d2a-max-refine (=0) must be >= 1"),
    (dict(teacher=None, d2a_teacher_cache=None), "--teacher (=None) is required"),
])
def test_d2a_refuses_bad_settings_before_any_data(settings, words):
    """They trained with a negative loss (alpha <= 0), failed after the teacher's generation (R_max 0) or inside
    `from_pretrained(None)` after the data loaded (no teacher)."""
    args = SimpleNamespace(**{"d2a_stage": 2, "d2a_alpha": 1.01, "d2a_max_refine": 96, **settings})
    with pytest.raises(ValueError, match=re.escape(words)):
        D2AObjective(args)


def test_d2a_teacher_cache_of_other_settings_is_refused(tmp_path):
    """A cache written for another teacher, seed or counts was reused silently (and the log named the new ones)."""
    args = SimpleNamespace(d2a_stage=1, teacher="models/qwen2-tiny-ar", seed=5, d2a_teacher_problems=40,
                           d2a_teacher_code=20, max_operand=20, train_problems=1000,
                           d2a_teacher_cache=str(tmp_path / "teacher.pt"))
    stream = (torch.arange(8), torch.ones(8, dtype=torch.bool))
    objective = D2AObjective(args)
    torch.save({"arith": stream, "code": stream, "settings": objective._teacher_settings()}, args.d2a_teacher_cache)
    assert objective.build_streams(None, [], [], None)["arith"][0].tolist() == list(range(8))
    args.seed = 9
    with pytest.raises(ValueError, match=r"other settings .*differ: seed\)"):
        D2AObjective(args).build_streams(None, [], [], None)


def test_d2a_stage1_loss_is_finite_and_only_on_continuations():
    from model_patches.sdar import SDARConfig, SDARForCausalLM

    torch.manual_seed(0)
    model = SDARForCausalLM(SDARConfig(block_size=4, mask_token_id=2, head_dim=8, **SMALL)).eval()
    x = torch.randint(3, 40, (2, 16))
    nothing = torch.zeros(2, 16, dtype=torch.bool)
    objective = D2AObjective(SimpleNamespace(d2a_stage=1))
    assert objective.loss(model, x, nothing, torch.Generator().manual_seed(1)).item() == 0.0
    value = objective.loss(model, x, torch.ones(2, 16, dtype=torch.bool), torch.Generator().manual_seed(1))
    assert torch.isfinite(value) and float(value) > 0


def test_depth_growth_preserves_the_logits_then_trains_every_layer():
    """Block expansion (`--grow-layers`): inserted copies have zero output projections, so the grown model computes
    the original's logits exactly; their other weights still get gradients once the projections move."""
    import pytest

    from conftest import MASK_ID, TINY
    from model_patches.sdar import SDARConfig, SDARForCausalLM
    from recipes.growth import expansion_plan, grow_depth

    torch.manual_seed(0)
    model = SDARForCausalLM(SDARConfig(block_size=4, mask_token_id=MASK_ID, **TINY)).eval()
    ids = torch.randint(0, 90, (2, 11))
    before = model(ids).logits
    grown = grow_depth(model, 6)
    assert grown.config.num_hidden_layers == 6 == len(grown.model.layers) == len(grown.config.layer_types)
    assert [layer.self_attn.layer_idx for layer in grown.model.layers] == list(range(6))
    torch.testing.assert_close(grown(ids).logits, before, atol=0, rtol=0)
    grown(ids).logits.sum().backward()
    assert grown.model.layers[1].self_attn.o_proj.weight.grad.abs().sum() > 0
    assert expansion_plan(2, 6) == [(0, False), (0, True), (0, True), (1, False), (1, True), (1, True)]
    with pytest.raises(ValueError, match="--grow-layers"):
        expansion_plan(4, 6)


def test_llada2_loss_equals_explicit_m2t_plus_t2t():
    """M2T on masked positions (1/t weighted) + T2T on every visible maskable position (random-token corruption
    of some), over the maskable count; questions are never masked, corrupted or a target."""
    from model_patches.llada2 import LLaDA2MoeConfig, LLaDA2MoeModelLM
    from recipes.objectives import LLaDA2Objective

    torch.manual_seed(0)
    model = LLaDA2MoeModelLM(LLaDA2MoeConfig(
        vocab_size=40, hidden_size=32, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2, n_group=2, topk_group=1,
        moe_intermediate_size=8, initializer_range=0.2, pad_token_id=None, eos_token_id=None,
        attn_implementation="sdpa")).eval()
    objective = LLaDA2Objective(SimpleNamespace())
    objective.edit_max_rate = 0.9                                   # corrupt often, so the case is exercised
    x, maskable, loss, gen, t, noise = _block_diffusion_case(objective, model, 3)
    b, seq_len = x.shape
    rate = torch.rand(b, generator=gen) * 0.9
    corrupt = maskable & ~noise & (torch.rand(b, seq_len, generator=gen) < rate[:, None])
    random_tokens = torch.randint(3, 40, (b, seq_len), generator=gen)
    assert corrupt.any() and noise.any()
    total = torch.tensor(0.0)
    for row in range(b):
        noisy = torch.where(noise[row], torch.tensor(2), torch.where(corrupt[row], random_tokens[row], x[row]))
        logits = _noisy_logits(model, noisy, x[row])
        for i in range(seq_len):
            ce = torch.nn.functional.cross_entropy(logits[i][None], x[row, i][None])
            if noise[row, i]:
                total = total + ce / t[row]
            elif maskable[row, i]:
                total = total + ce
    assert torch.allclose(loss, total / maskable.sum(), atol=1e-5)


def test_sdar_to_llada2_upcycling_preserves_the_logits():
    """The converted MoE (fused QKV, dense slices as experts, zero router) computes the SDAR model's logits."""
    from hf_dllm_spec.maths.masks import block_causal_mask
    from model_patches.sdar import SDARConfig, SDARForCausalLM
    from recipes.upcycle import sdar_to_llada2

    torch.manual_seed(0)
    sdar = SDARForCausalLM(SDARConfig(**{**SMALL, "intermediate_size": 48}, head_dim=8, mask_token_id=39)).eval()
    moe = sdar_to_llada2(sdar, moe_intermediate_size=8, num_shared_experts=2).eval()     # 32 / 8 = 4 slices
    assert moe.config.num_experts == 8 and moe.config.num_experts_per_tok == 4 and moe.config.first_k_dense_replace == 1
    x = torch.randint(3, 39, (2, 12))
    positions = torch.arange(12)[None].expand(2, -1)
    allowed = block_causal_mask(positions, 4)[:, None]                                # (2, 1, 12, 12) bool
    additive = torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)
    causal = torch.zeros(2, 1, 12, 12).masked_fill(~torch.ones(12, 12, dtype=torch.bool).tril(),
                                                   torch.finfo(torch.float32).min)
    assert torch.allclose(moe(x, attention_mask=additive).logits, sdar(x, attention_mask=additive).logits, atol=1e-5)
    assert torch.allclose(moe(x, attention_mask=causal).logits, sdar(x).logits, atol=1e-5)    # SDAR's default: causal


def test_no_training_stream_holds_a_held_out_question():
    """A stage at operand limit 50 skipped only the limit-50 split, so 132 of the 500 questions of the limit-20 split
    the bundled models are evaluated on were in its training problems; every shipped split is excluded now."""
    from recipes.arithmetic import HELDOUT_LIMITS, generate_problems, heldout_problems, heldout_questions

    excluded = heldout_questions(50)
    assert all(p["question"] in excluded for limit in HELDOUT_LIMITS for p in heldout_problems(max_operand=limit))
    drawn = {p["question"] for p in generate_problems(30_000, seed=1, exclude=excluded, max_operand=50)}
    assert not drawn & {p["question"] for p in heldout_problems(max_operand=20)}


def test_continuing_a_fast_dllm_checkpoint_records_the_trained_block_size(tmp_path):
    """Before: `--bd-size 16` on a Fast-dLLM checkpoint trained blocks of 16 but kept the checkpoint's `bd_size`, the
    library's default decoding block size."""
    config = Fast_dLLM_QwenConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                  num_attention_heads=4, num_key_value_heads=2, bd_size=32)
    Fast_dLLM_QwenForCausalLM(config).save_pretrained(tmp_path)
    objective = FastDLLMV2Objective(SimpleNamespace(bd_size=16))
    assert objective.build_model(objective.args, None, str(tmp_path)).config.bd_size == 16


@pytest.mark.parametrize("argv,words", [
    (["--objective", "fast_dllm_v2", "--seq-len", "10", "--bd-size", "4"],
     "--seq-len (=10) must be a multiple of --bd-size (=4) for --objective fast_dllm_v2"),
    (["--objective", "llada2", "--init-from", "models/sdar-tiny-arith", "--grow-layers", "8"],
     "--grow-layers grows dense decoders"),
    (["--objective", "block_diffusion", "--grow-layers", "8"], "--grow-layers needs --init-from"),
    (["--objective", "ar", "--resume"], "--resume needs"),
    (["--objective", "ar", "--batch-size", "0"], "--batch-size (=0) must be >= 1"),
    (["--objective", "ar", "--train-problems", "0"], "--train-problems (=0) must be >= 1"),
    (["--objective", "ar", "--bd-size", "0"], "--bd-size (=0) must be >= 1"),
    (["--objective", "ar", "--arith-fraction", "1.5"], "--arith-fraction (=1.5) must lie in [0, 1]"),
    (["--objective", "ar", "--lr", "0"], "--lr (=0.0) must be a number > 0"),
    (["--objective", "ar", "--checkpoint-minutes", "0"], "--checkpoint-minutes (=0.0) must be > 0 minutes"),
    # a starting model or teacher of another family was loaded anyway (a mostly random model trained), and the
    # required ones were asked for after minutes of data preparation, with a traceback
    (["--objective", "llada2", "--init-from", "models/qwen2-tiny-ar"],
     "--init-from (=models/qwen2-tiny-ar) must be a checkpoint of model_type 'sdar' or 'llada2_moe'"),
    (["--objective", "fast_dllm_v2", "--init-from", "models/sdar-tiny-arith"],
     "must be a checkpoint of model_type 'qwen2' or 'Fast_dLLM_Qwen' for --objective fast_dllm_v2 (it is 'sdar')"),
    (["--objective", "d2a", "--init-from", "models/sdar-tiny-arith", "--teacher", "models/sdar-tiny-arith"],
     "--teacher (=models/sdar-tiny-arith) must be a checkpoint of model_type 'qwen2'"),
    (["--objective", "d2a", "--teacher", "models/qwen2-tiny-ar"], "--init-from is required for --objective d2a"),
    (["--objective", "fast_dllm_v2"], "--init-from is required for --objective fast_dllm_v2"),
    (["--objective", "d2a", "--init-from", "models/sdar-tiny-arith"], "--teacher (=None) is required"),
    (["--objective", "block_diffusion", "--init-from", "/nonexistent"],
     "--init-from (=/nonexistent) must be a checkpoint directory with a config.json"),
    (["--objective", "block_diffusion", "--init-from", "models/sdar-tiny-arith", "--tokenizer-from",
      "models/sdar-tiny-arith"], "--tokenizer-from must be left out with --init-from"),
    (["--objective", "block_diffusion", "--init-from", "models/sdar-tiny-arith", "--grow-layers", "0"],
     "--grow-layers (=0) must be a multiple of the --init-from model's"),
    (["--objective", "ar", "--max-operand", "1"], "--max-operand (=1) must be >= 3"),
    (["--objective", "ar", "--seq-len", "1"], "--seq-len (=1) must be >= 2 for --objective ar"),
])
def test_train_refuses_bad_arguments_before_any_data(argv, words, tmp_path, capsys):
    """They crashed after the data loaded (a window of 10 against blocks of 4, LLaDA2's layers grown as dense ones,
    a missing resume.pt) or inside the tokenizer library (no problems), or trained on nonsense."""
    from recipes.train import parse_args

    with pytest.raises(SystemExit) as exit_info:
        parse_args([*argv, "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and words in err, err


def test_training_windows_reach_the_last_token_and_fit_a_stream_of_one_window():
    """`randint(0, N - seq_len)` never drew the window ending on a stream's last token (its final EOS) and failed on
    a stream of exactly one window."""
    from recipes.train import check_streams, sample_batch

    ids = torch.arange(10)
    streams = {"arith": (ids, torch.ones(10, dtype=torch.bool)), "code": (ids[:4], torch.ones(4, dtype=torch.bool))}
    gen = torch.Generator().manual_seed(0)
    ends = {int(row[-1]) for _ in range(50) for row in sample_batch(streams, 4, 4, 1.0, gen)[0]}
    assert ends == set(range(3, 10))                               # every window, the last (ending on 9) included
    assert sample_batch(streams, 2, 4, 0.0, gen)[0].tolist() == [[0, 1, 2, 3]] * 2
    check_streams(streams, 4, 0.5)
    with pytest.raises(ValueError, match=re.escape("--seq-len (=5) must be at most the code stream's 4 tokens")):
        check_streams(streams, 5, 0.5)
    check_streams(streams, 5, 1.0)                                 # the code stream is never sampled


def test_an_objective_serves_windows_of_another_length():
    """The block mask was kept per block size only: a second length reused the first length's mask."""
    torch.manual_seed(0)
    model = Fast_dLLM_QwenForCausalLM(Fast_dLLM_QwenConfig(bd_size=4, **SMALL)).eval()
    objective = FastDLLMV2Objective(SimpleNamespace(bd_size=4))
    objective.mask_id = 39
    for seq_len in (8, 12):
        x = torch.randint(3, 39, (2, seq_len))
        loss = objective.loss(model, x, torch.ones(2, seq_len, dtype=torch.bool), torch.Generator().manual_seed(1))
        assert torch.isfinite(loss)
    assert objective.block_mask(12, 4).shape == (1, 1, 24, 24)
    assert torch.equal(objective.block_mask(8, 4)[0, 0], bd_training_mask(8, 4))


def test_d2a_refuses_no_teacher_even_with_an_existing_cache(tmp_path):
    """A cache without `--teacher` was accepted, then refused after the data loaded: the cache records its teacher."""
    cache = tmp_path / "teacher.pt"
    cache.write_bytes(b"")
    args = SimpleNamespace(d2a_stage=1, teacher=None, d2a_teacher_cache=str(cache))
    with pytest.raises(ValueError, match=re.escape("--teacher (=None) is required")):
        D2AObjective(args)


def test_the_resume_point_is_replaced_whole_or_not_at_all(tmp_path, monkeypatch):
    """A run killed while writing `resume.pt` left a truncated archive in place of the last good one (`--resume`
    then failed): the new one is written beside it and renamed over it."""
    from recipes.train import save_resume

    path = tmp_path / "resume.pt"
    save_resume(path, {"state": {"step": 1}})
    real_save = torch.save

    def killed(obj, target):
        real_save(obj, target)
        pathlib.Path(target).write_bytes(pathlib.Path(target).read_bytes()[:20])    # cut short, then "killed"
        raise KeyboardInterrupt

    monkeypatch.setattr(torch, "save", killed)
    with pytest.raises(KeyboardInterrupt):
        save_resume(path, {"state": {"step": 2}})
    assert torch.load(path, weights_only=False)["state"]["step"] == 1


def test_a_stage_stopped_by_max_minutes_keeps_its_resume_point_and_resumes_to_the_end(tmp_path):
    """A `--max-minutes` stop saved the model and deleted `resume.pt`, so the run could not continue (the model
    cards run stages with `--checkpoint-minutes` and `--max-minutes`); now it keeps a current one, and `--resume`
    trains the remaining steps and removes it."""
    from recipes.train import main

    args = ["--objective", "ar", "--init-from", "models/qwen2-tiny-ar", "--out", str(tmp_path), "--tokens", "320",
            "--seq-len", "16", "--batch-size", "2", "--train-problems", "20"]
    main([*args, "--max-minutes", "1e-9"])                                  # stops after its first step
    assert (tmp_path / "resume.pt").is_file()
    assert json.loads((tmp_path / "training_log.json").read_text())["stages"][-1]["steps"] == 1
    main([*args, "--resume"])
    assert not (tmp_path / "resume.pt").exists()
    assert json.loads((tmp_path / "training_log.json").read_text())["stages"][-1]["steps"] == 10
