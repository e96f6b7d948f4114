"""End-to-end SimSD on the bundled pair: target `models/sdar-large` (14.7M), drafter `models/sdar-tiny-arith`
(5.25M), same tokenizer and block size 4; real prompts, CPU fp32."""

from __future__ import annotations

import pytest
import torch

from hf_dllm_spec.tools.jobs.evaluation import ROOT, StrategySpec, arithmetic_prompts, humaneval_prompts, load, run

TARGET_DIR = ROOT / "models" / "sdar-large"
DRAFTER_DIR = ROOT / "models" / "sdar-tiny-arith"

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def pair():
    tokenizer, target = load(TARGET_DIR)
    _, drafter = load(DRAFTER_DIR)
    texts = [p.text for p in arithmetic_prompts(TARGET_DIR, 8)] + [humaneval_prompts(1)[0].text]
    return tokenizer, target, drafter, [tokenizer(t, return_tensors="pt").input_ids for t in texts]


def _simsd(target, drafter, ids, **kwargs):
    return target.generate(ids, decoding_strategy="simsd", draft_model=drafter, max_new_tokens=40, **kwargs)


def test_target_is_a_larger_sdar_checkpoint_with_the_drafter_tokenizer_and_block_size(pair):
    from transformers import PreTrainedTokenizerFast

    tokenizer, target, drafter, _ = pair
    assert type(target).__name__ == "SDARForCausalLM" and target.config.mask_token_id == 2
    assert target.config.block_size == drafter.config.block_size == 4
    size = sum(p.numel() for p in target.parameters())
    assert size >= 2.5 * sum(p.numel() for p in drafter.parameters())
    text = "def f(x):\n    return x + 12\nQuestion: Tom has 3 apples.\nAnswer:"
    assert PreTrainedTokenizerFast.from_pretrained(TARGET_DIR)(text).input_ids == tokenizer(text).input_ids


def test_exact_preset_equals_the_target_sequential_block_diffusion(pair):
    _, target, drafter, prompts = pair
    for ids in prompts[:3] + prompts[-1:]:
        assert torch.equal(_simsd(target, drafter, ids, preset="simsd-exact"),
                           target.generate(ids, decoding_strategy="block_diffusion", remasking_strategy="sequential",
                                           steps_per_block=4, max_new_tokens=40))


def test_batch_of_4_equals_singles(pair):
    tokenizer, target, drafter, prompts = pair
    tokenizer.padding_side = "left"
    texts = [tokenizer.decode(p[0]) for p in prompts[:3] + prompts[-1:]]
    enc = tokenizer(texts, return_tensors="pt", padding=True)
    batch = _simsd(target, drafter, enc.input_ids, attention_mask=enc.attention_mask)
    for n, ids in enumerate(prompts[:3] + prompts[-1:]):
        single = _simsd(target, drafter, ids)[0, ids.shape[1]:]
        assert torch.equal(batch[n, enc.input_ids.shape[1]:][: single.shape[0]], single)


def test_the_small_drafter_is_mostly_accepted_on_arithmetic(pair):
    """alpha on 8 held-out problems (the benchmark has 50); the drafter's forwards are the cheaper ones."""
    tokenizer, target, drafter, _ = pair
    prompts = arithmetic_prompts(TARGET_DIR, 8)
    result = run(target, tokenizer, prompts, StrategySpec("SimSD", "simsd", {}, draft_model=drafter),
                 max_new_tokens=48, seed=0, progress=False)
    stats = result.stats
    assert stats.acceptance_rate >= 0.8, stats.acceptance_rate
    assert stats.num_draft_model_forwards > stats.num_verify_forwards
    assert stats.draft_target_time_ratio < 1.0
    assert result.accuracy >= 50.0


def test_sampling_runs_with_a_seed(pair):
    _, target, drafter, prompts = pair
    kwargs = dict(do_sample=True, temperature=0.8, generator=torch.Generator().manual_seed(0))
    first = _simsd(target, drafter, prompts[0], **kwargs)
    kwargs["generator"] = torch.Generator().manual_seed(0)
    assert torch.equal(first, _simsd(target, drafter, prompts[0], **kwargs))


def test_all_shipped_weights_stay_under_100_mb():
    total = sum(path.stat().st_size for path in (ROOT / "models").glob("*/model.safetensors"))
    assert total < 100e6, f"{total / 1e6:.1f} MB of bundled weights"
