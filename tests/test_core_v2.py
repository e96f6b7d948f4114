"""Core v2: alignment as data, the token-editing hook, the drafter slot, the registry merge, one-way imports."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch
from conftest import MASK_ID, TINY
from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

import hf_dllm_spec
from hf_dllm_spec import DrafterConfig, EditRule, S2D2Config, register_strategy, resolve_config
from hf_dllm_spec.maths.masks import block_causal_mask, causal_mask, concat_segments, full_mask, to_additive
from hf_dllm_spec.outputs import BatchStats
from hf_dllm_spec.strategies.registry import STRATEGIES
from hf_dllm_spec.runtime.runner import ModelRunner
from hf_dllm_spec.strategies import ARConfig, ARStrategy, BlockDiffusionConfig, BlockDiffusionStrategy
from model_patches import get_patch

ATOL = dict(atol=1e-5, rtol=1e-5)
GREEDY = dict(eos_token_id=None, do_sample=False)


@pytest.fixture(scope="module")
def qwen2_ar():
    """A tiny Qwen2 AR model (transformers' own modeling), declared right-shifted."""
    torch.manual_seed(1)
    config = Qwen2Config(**{k: v for k, v in TINY.items() if k != "head_dim"}, dllm_alignment="right_shift")
    return Qwen2ForCausalLM(config).eval()


# -- alignment ---------------------------------------------------------------------------------------------------

def test_right_shifted_qwen2_ar_equals_transformers_greedy(qwen2_ar, prompt):
    stock = qwen2_ar.generate(prompt, max_new_tokens=12, **GREEDY)
    ours = qwen2_ar.generate(prompt, custom_generate=hf_dllm_spec.custom_generate, decoding_strategy="ar",
                             max_new_tokens=12, return_dict_in_generate=True, **GREEDY)
    assert ours.sequences.tolist() == stock.tolist()
    assert ours.spec_stats.nfe == 1 + 12                        # prefill + one forward per token


def test_right_shifted_batch_equals_transformers_batched_greedy(qwen2_ar):
    ids = torch.tensor([[0, 0, 0, 5, 17, 42], [0, 9, 8, 7, 6, 5], [11, 12, 13, 14, 15, 16]])
    mask = (ids != 0).long()
    stock = qwen2_ar.generate(ids, attention_mask=mask, max_new_tokens=9, pad_token_id=0, **GREEDY)
    ours = qwen2_ar.generate(ids, attention_mask=mask, custom_generate=hf_dllm_spec.custom_generate,
                             decoding_strategy="ar", max_new_tokens=9, pad_token_id=0, **GREEDY)
    assert ours.tolist() == stock.tolist()


def test_position_alignment_would_differ(qwen2_ar, prompt):
    """The same weights declared position-aligned give other tokens: the alignment is really applied."""
    stock = qwen2_ar.generate(prompt, max_new_tokens=8, **GREEDY)
    qwen2_ar.config.dllm_alignment = "position"
    try:
        ours = qwen2_ar.generate(prompt, custom_generate=hf_dllm_spec.custom_generate, decoding_strategy="ar",
                                 mask_token_id=MASK_ID, max_new_tokens=8, **GREEDY)
    finally:
        qwen2_ar.config.dllm_alignment = "right_shift"
    assert ours.tolist() != stock.tolist()


def test_right_shift_runner_reads_predecessor_rows_and_carry(qwen2_ar):
    """Block logits at j come from row j - 1; the block's first from the last stored token (the carry)."""
    seq = torch.tensor([5, 17, 42, 8, 23, 61, 4, 9, 33, 7, 61, 12])
    prefix, B = 8, 4
    runner = ModelRunner(qwen2_ar, get_patch(qwen2_ar), BatchStats(1), batch_size=1)
    pos = torch.arange(12)[None]
    runner.forward(seq[None, :prefix], pos[:, :prefix], block_causal_mask(pos[:, :prefix], B), kind="prefill",
                   store_len=prefix)
    aligned = runner.forward(seq[None, prefix:], pos[:, prefix:], full_mask(B), kind="draft")      # read-only
    full = qwen2_ar(input_ids=seq[None], position_ids=pos,
                    attention_mask=to_additive(block_causal_mask(pos, B), torch.float32)).logits
    torch.testing.assert_close(aligned[0], full[0, prefix - 1:prefix + B - 1], **ATOL)
    # Fused [store block | next block]: the next block's first logits come from the stored block's last row.
    nxt = torch.tensor([[1, 2, 3, 4]])
    ids = torch.cat([seq[None, prefix:], nxt], dim=1)
    pos2 = torch.arange(prefix, prefix + 2 * B)[None]
    fused = runner.forward(ids, pos2, concat_segments(block_causal_mask(pos2[:, :B], B), full_mask(B)),
                           kind="draft", store_len=B, logits_to_keep=B)
    seq2 = torch.cat([seq, nxt[0]])[None]
    pos_all = torch.arange(16)[None]
    full2 = qwen2_ar(input_ids=seq2, position_ids=pos_all,
                     attention_mask=to_additive(block_causal_mask(pos_all, B), torch.float32)).logits
    torch.testing.assert_close(fused[0], full2[0, 11:15], **ATOL)
    alone = runner.forward(nxt, pos2[:, B:], full_mask(B), kind="draft")                            # carry
    torch.testing.assert_close(alone[0], full2[0, 11:15], **ATOL)


def test_right_shift_carry_is_the_last_stored_token_whatever_is_kept(qwen2_ar):
    """A forward that stores 2 of its 6 query tokens and keeps 1 logit (fewer than its read-only tail) still leaves
    the carry of its last stored token: the next query's first logits equal a full causal forward's."""
    seq = torch.tensor([5, 17, 42, 8, 23, 61, 4, 9, 33, 7])
    runner = ModelRunner(qwen2_ar, get_patch(qwen2_ar), BatchStats(1), batch_size=1)
    pos = torch.arange(10)[None]
    runner.forward(seq[None, :4], pos[:, :4], causal_mask(4), kind="prefill", store_len=4)
    runner.forward(seq[None, 4:], pos[:, 4:], causal_mask(6), kind="draft", store_len=2, logits_to_keep=1)
    following = runner.forward(seq[None, 6:7], pos[:, 6:7], full_mask(1), kind="draft")
    full = qwen2_ar(input_ids=seq[None, :7], position_ids=pos[:, :7]).logits
    torch.testing.assert_close(following[0, 0], full[0, 5], **ATOL)             # predicts position 6


def test_right_shifted_block_diffusion_and_s2d2_cache_equals_no_cache(qwen2_ar, prompt):
    for strategy, extra in (("block_diffusion", {}), ("s2d2", {"cache_ver": True, "draft_ver": True})):
        kwargs = dict(custom_generate=hf_dllm_spec.custom_generate, decoding_strategy=strategy, block_size=4,
                      mask_token_id=MASK_ID, max_new_tokens=12, **GREEDY, **extra)
        assert torch.equal(qwen2_ar.generate(prompt, **kwargs), qwen2_ar.generate(prompt, use_cache=False, **kwargs))


def test_right_shifted_s2d2_always_verify_equals_ar(qwen2_ar, prompt):
    """The right-shift verifier layout ([x~] causal) reproduces AR greedy, as the 2L layout does for SDAR."""
    common = dict(custom_generate=hf_dllm_spec.custom_generate, max_new_tokens=12, **GREEDY)
    ar = qwen2_ar.generate(prompt, decoding_strategy="ar", **common)
    s2d2 = qwen2_ar.generate(prompt, decoding_strategy="s2d2", block_size=4, mask_token_id=MASK_ID,
                             min_ssd_span_length=1, cache_ver=True, draft_ver=True, **common)
    assert s2d2.tolist() == ar.tolist()


def test_bad_declared_alignment_raises(qwen2_ar, prompt):
    qwen2_ar.config.dllm_alignment = "left"
    try:
        with pytest.raises(ValueError, match=r"`config.dllm_alignment` \(='left'\) must be one of"):
            qwen2_ar.generate(prompt, custom_generate=hf_dllm_spec.custom_generate, decoding_strategy="ar")
    finally:
        qwen2_ar.config.dllm_alignment = "right_shift"


# -- token editing -----------------------------------------------------------------------------------------------

class NeverEdit(EditRule):
    max_post_steps = 1

    def __call__(self, *, tokens, editable, probs, proposal, confidence):
        return torch.zeros_like(editable)


class EditToProposal(EditRule):
    """LLaDA2.1 T2T with tau_edit = 0: every committed position takes this step's proposal."""

    max_post_steps = 3

    def __call__(self, *, tokens, editable, probs, proposal, confidence):
        return editable & (proposal != tokens)


def _editing_strategy(rule: EditRule):
    @dataclass
    class ToyEditingConfig(BlockDiffusionConfig):
        decoding_strategy: ClassVar[str] = "toy_editing"

    class ToyEditing(BlockDiffusionStrategy):
        name = "toy_editing"
        config_class = ToyEditingConfig
        edit_rule = rule

    return ToyEditing


@pytest.fixture
def registered():
    added = []

    def add(strategy):
        register_strategy(strategy)
        added.append(strategy.name)
        return strategy

    before = dict(STRATEGIES)
    yield add
    STRATEGIES.clear()
    STRATEGIES.update(before)
    register_strategy(before["ar"])          # (refreshes the keywords `generate` accepts, as each registration does)


def test_edit_hook_off_costs_nothing_and_never_firing_rule_costs_one_post_step(sdar_model, prompt, registered):
    registered(_editing_strategy(NeverEdit()))
    kwargs = dict(max_new_tokens=12, block_size=4, return_dict_in_generate=True, **GREEDY)
    base = sdar_model.generate(prompt, decoding_strategy="block_diffusion", **kwargs)
    toy = sdar_model.generate(prompt, decoding_strategy="toy_editing", **kwargs)
    assert torch.equal(base.sequences, toy.sequences)
    blocks = base.spec_stats.num_committed_tokens // 4 + 1          # the first block holds 3 prompt tokens
    assert toy.spec_stats.num_draft_forwards == base.spec_stats.num_draft_forwards + blocks
    assert toy.spec_stats.num_edited_tokens == 0 == base.spec_stats.num_edited_tokens


def test_edit_rule_re_decides_committed_tokens(sdar_model, prompt, registered):
    registered(_editing_strategy(EditToProposal()))
    kwargs = dict(max_new_tokens=16, block_size=4, return_dict_in_generate=True, confidence_threshold=0.3,
                  **GREEDY)
    base = sdar_model.generate(prompt, decoding_strategy="block_diffusion", **kwargs)
    edited = sdar_model.generate(prompt, decoding_strategy="toy_editing", **kwargs)
    s = edited.spec_stats
    assert s.num_edited_tokens > 0
    assert not torch.equal(base.sequences, edited.sequences)
    assert s.num_committed_tokens == s.num_generated_tokens + s.num_discarded_tokens
    # Each block ran at most max_post_steps steps after it filled.
    blocks = -(-(3 + 16) // 4)
    assert s.num_draft_forwards <= base.spec_stats.num_draft_forwards + 3 * blocks + 4 * blocks
    # Prompt tokens are never edited, and editing is exact under the cache.
    assert edited.sequences[0, : prompt.shape[1]].tolist() == prompt[0].tolist()
    no_cache = sdar_model.generate(prompt, decoding_strategy="toy_editing", use_cache=False, **kwargs)
    assert torch.equal(edited.sequences, no_cache.sequences)


# -- the drafter slot ----------------------------------------------------------------------------------------------

@dataclass
class DrafterARConfig(ARConfig, DrafterConfig):
    decoding_strategy: ClassVar[str] = "toy_drafter_ar"


class DrafterAR(ARStrategy):
    """Test-only: AR decoding with the drafter runner (shows it has its own patch, cache and alignment)."""

    name = "toy_drafter_ar"
    config_class = DrafterARConfig
    uses_drafter = True
    requires_mask_token = False

    def __init__(self, config, session):
        super().__init__(config, session)
        session.target, session.drafter = session.drafter, session.target


def test_drafter_runs_with_its_own_patch_cache_and_alignment(sdar_model, qwen2_ar, prompt, registered):
    registered(DrafterAR)
    stock = qwen2_ar.generate(prompt, max_new_tokens=8, **GREEDY)
    for alias in ("draft_model", "assistant_model"):
        out = sdar_model.generate(prompt, decoding_strategy="toy_drafter_ar", max_new_tokens=8,
                                  **{alias: qwen2_ar}, **GREEDY)
        assert out.tolist() == stock.tolist()          # the right-shifted drafter decoded, not the SDAR target


def test_drafter_checks_before_any_forward(sdar_model, qwen_model, qwen2_ar, prompt, registered, monkeypatch):
    registered(DrafterAR)
    monkeypatch.setattr(sdar_model, "forward", lambda *a, **k: (_ for _ in ()).throw(AssertionError("forward")))
    with pytest.raises(ValueError, match=r"`draft_model` \(=None\) must be given"):
        sdar_model.generate(prompt, decoding_strategy="toy_drafter_ar")
    with pytest.raises(ValueError, match=r"`draft_block_size` \(=8\) must equal `block_size` \(=1\)"):
        sdar_model.generate(prompt, decoding_strategy="toy_drafter_ar", draft_model=qwen2_ar, draft_block_size=8)
    other_vocab = Qwen2ForCausalLM(Qwen2Config(**{**{k: v for k, v in TINY.items() if k != "head_dim"},
                                                  "vocab_size": 120})).eval()
    with pytest.raises(ValueError, match=r"`draft_model` .* must share the target's vocabulary of 99 tokens"):
        sdar_model.generate(prompt, decoding_strategy="toy_drafter_ar", draft_model=other_vocab)
    # The models' own stop ids differ (another tokenizer): refused. A per-call stop list is not compared: both models
    # stop on it (tests/test_bad_inputs.py::test_per_call_stop_list_applies_to_both_models).
    own_eos = sdar_model.generation_config.eos_token_id
    qwen2_ar.generation_config.eos_token_id, sdar_model.generation_config.eos_token_id = 7, 9
    try:
        with pytest.raises(ValueError, match=r"`draft_model` \(='<eos_token_id=\[7\]>'\) must use the target's "
                                             r"eos_token_id \(\[9\]\)"):
            sdar_model.generate(prompt, decoding_strategy="toy_drafter_ar", draft_model=qwen2_ar)
    finally:
        qwen2_ar.generation_config.eos_token_id, sdar_model.generation_config.eos_token_id = None, own_eos
    with pytest.raises(ValueError, match=r"`draft_model` .* must be None for decoding_strategy='s2d2'"):
        sdar_model.generate(prompt, decoding_strategy="s2d2", draft_model=qwen2_ar)
    # transformers drops `assistant_model` for custom_generate callables: it is still seen, never ignored.
    with pytest.raises(ValueError, match=r"`draft_model` .* must be None for decoding_strategy='s2d2'"):
        qwen_model.generate(prompt, custom_generate=hf_dllm_spec.custom_generate, decoding_strategy="s2d2",
                            mask_token_id=MASK_ID, block_size=4, assistant_model=qwen2_ar)


# -- registry and parameter merge ----------------------------------------------------------------------------------

def test_stored_preset_config_and_kwargs_merge_field_by_field():
    stored = S2D2Config(confidence_threshold=0.6, min_ssd_span_length=3, score_penalty_coef=0.5)
    gc = stored.save_to_generation_config(GenerationConfig())
    only_stored = resolve_config("s2d2", generation_config=gc)
    assert (only_stored.confidence_threshold, only_stored.min_ssd_span_length) == (0.6, 3)
    with_preset = resolve_config("s2d2", generation_config=gc, preset="sdar-1.7b-config-a")
    # The preset sets block size, policy, span and estimator; the stored threshold and penalty survive.
    assert (with_preset.block_size, with_preset.min_ssd_span_length) == (4, 2)
    assert (with_preset.confidence_threshold, with_preset.score_penalty_coef) == (0.6, 0.5)
    with_config = resolve_config("s2d2", generation_config=gc, preset="sdar-1.7b-config-a",
                                 strategy_config=S2D2Config(min_ssd_span_length=4))
    assert (with_config.min_ssd_span_length, with_config.block_size, with_config.confidence_threshold) == (4, 4, 0.6)
    with_kwargs = resolve_config("s2d2", generation_config=gc, preset="sdar-1.7b-config-a",
                                 strategy_config=S2D2Config(min_ssd_span_length=4),
                                 overrides={"min_ssd_span_length": 1, "confidence_threshold": 0.9})
    assert (with_kwargs.min_ssd_span_length, with_kwargs.confidence_threshold, with_kwargs.block_size) == (1, 0.9, 4)


def test_each_config_lives_beside_its_strategy():
    for name, strategy in STRATEGIES.items():
        assert strategy.config_class.decoding_strategy == name
        assert strategy.config_class.__module__ == strategy.__module__


def test_imports_go_one_way_and_leaf_modules_register_nothing():
    code = """
import sys
from transformers.models.auto.configuration_auto import CONFIG_MAPPING
import hf_dllm_spec.maths.masks, hf_dllm_spec.maths.verification, hf_dllm_spec.maths.routing
assert "model_patches" not in sys.modules, "a leaf module imported the families"
import model_patches, model_patches.sdar
assert "hf_dllm_spec.integration.generate" not in sys.modules, "model_patches imported the decoding code"
import hf_dllm_spec, hf_dllm_spec.integration.generate
assert "sdar" not in CONFIG_MAPPING, "an import registered SDAR with the Auto classes"
hf_dllm_spec.register_auto_classes()
assert "sdar" in CONFIG_MAPPING
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_strategy_config_overrides_the_fields_it_was_built_with_even_at_their_default():
    gc = S2D2Config(confidence_threshold=0.6).save_to_generation_config(GenerationConfig())
    assert resolve_config("s2d2", generation_config=gc,
                          strategy_config=S2D2Config(confidence_threshold=0.85)).confidence_threshold == 0.85
    assert resolve_config("s2d2", preset="sdar-1.7b-config-a",
                          strategy_config=S2D2Config(min_ssd_span_length=1)).min_ssd_span_length == 1
    assert resolve_config("s2d2", generation_config=gc,
                          strategy_config=S2D2Config(min_ssd_span_length=1)).confidence_threshold == 0.6


def test_direct_call_takes_generation_options_as_keywords(sdar_model, prompt):
    direct = hf_dllm_spec.dllm_generate(sdar_model, prompt, decoding_strategy="s2d2", max_new_tokens=6,
                                        eos_token_id=None)
    via_generate = sdar_model.generate(prompt, decoding_strategy="s2d2", max_new_tokens=6, eos_token_id=None)
    assert torch.equal(direct, via_generate)


@pytest.mark.parametrize("kwargs,match", [
    ({"input_ids": torch.empty(1, 0, dtype=torch.long)}, r"`input_ids` .* must hold at least one"),
    ({"position_ids": torch.arange(7)[None] + 100}, r"`position_ids` .* must follow the attention mask"),
    ({"cache_implementation": "offloaded"}, r"`cache_implementation` \(='offloaded'\) must be unset, 'dynamic' .* or 'static'"),
    ({"max_new_tokens": 250}, r"up to position 260\), in the model's 256 positions"),     # 249 would fit
])
def test_more_bad_input_before_any_forward(sdar_model, prompt, monkeypatch, kwargs, match):
    ids = kwargs.pop("input_ids", prompt)
    monkeypatch.setattr(sdar_model, "forward", lambda *a, **k: (_ for _ in ()).throw(AssertionError("forward")))
    with pytest.raises(ValueError, match=match):
        sdar_model.generate(ids, decoding_strategy="block_diffusion", block_size=4, **kwargs)


def test_positions_are_checked_for_whole_blocks(sdar_model, prompt, monkeypatch):
    """7 prompt tokens + 2 new ones end inside the block 8..11: position 11 must exist (max 256 here)."""
    monkeypatch.setattr(sdar_model.config, "max_position_embeddings", 11)
    with pytest.raises(ValueError, match=r"up to position 12\), in the model's 11 positions"):
        sdar_model.generate(prompt, decoding_strategy="block_diffusion", block_size=4, max_new_tokens=2)


def test_drafter_mask_token_and_zero_special_ids_are_checked(sdar_model, qwen2_ar, prompt, registered):
    class NeedsDraftMask(DrafterAR):
        name = "toy_drafter_mask"
        requires_draft_mask_token = True

    @dataclass
    class NeedsDraftMaskConfig(DrafterARConfig):
        decoding_strategy: ClassVar[str] = "toy_drafter_mask"

    NeedsDraftMask.config_class = NeedsDraftMaskConfig
    registered(NeedsDraftMask)
    with pytest.raises(ValueError, match=r"`draft_mask_token_id` \(=None\) must be known"):
        sdar_model.generate(prompt, decoding_strategy="toy_drafter_mask", draft_model=qwen2_ar, max_new_tokens=4)
    registered(DrafterAR)
    before = qwen2_ar.generation_config.pad_token_id, sdar_model.generation_config.pad_token_id
    qwen2_ar.generation_config.pad_token_id, sdar_model.generation_config.pad_token_id = 5, 0   # the models' own
    try:
        match = r"`draft_model` \(='<pad_token_id=5>'\) must use the target's pad_token_id \(0\)"
        with pytest.raises(ValueError, match=match):
            sdar_model.generate(prompt, decoding_strategy="toy_drafter_ar", draft_model=qwen2_ar, max_new_tokens=4,
                                eos_token_id=None)
    finally:
        qwen2_ar.generation_config.pad_token_id, sdar_model.generation_config.pad_token_id = before


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_no_device_sync_per_forward_on_cuda(sdar_model, prompt, monkeypatch):
    """Statistics and forward timing never synchronise the device per forward (CUDA events, read once)."""
    model = type(sdar_model)(sdar_model.config).to("cuda").eval()
    calls = []
    original = torch.cuda.synchronize
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: (calls.append(1), original(*a, **k))[1])
    out = model.generate(prompt.cuda(), decoding_strategy="block_diffusion", max_new_tokens=32, eos_token_id=None,
                         return_dict_in_generate=True)
    assert out.spec_stats.nfe > 8 and len(calls) <= 2          # the call's start and end only
    assert 0 < out.spec_stats.forward_time_s <= out.spec_stats.wall_time_s


def test_a_preset_of_another_strategy_names_that_strategy(sdar_model, prompt):
    """Before: "must be one of '<none>'; use one of the presets of decoding_strategy='block_diffusion'" for an S2D2
    preset on SDAR without `decoding_strategy` (the native strategy has no presets)."""
    with pytest.raises(ValueError, match=r"\(it is one of decoding_strategy='s2d2'\); pass decoding_strategy='s2d2'"):
        sdar_model.generate(prompt, preset="sdar-1.7b-config-a", max_new_tokens=4)
