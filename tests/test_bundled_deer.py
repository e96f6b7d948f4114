"""End-to-end DEER on the bundled pair: target `models/qwen2-tiny-ar`, drafter `models/deer-drafter-tiny`
(D2A-aligned from `models/sdar-tiny-arith`); real prompts, CPU fp32."""

from __future__ import annotations

import pytest
import torch

import hf_dllm_spec
from hf_dllm_spec.tools.jobs.evaluation import ROOT, arithmetic_prompts, humaneval_prompts, load

AR_DIR = ROOT / "models" / "qwen2-tiny-ar"
DRAFTER_DIR = ROOT / "models" / "deer-drafter-tiny"
UNALIGNED_DIR = ROOT / "models" / "sdar-tiny-arith"

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def pair():
    tokenizer, target = load(AR_DIR)
    _, drafter = load(DRAFTER_DIR)
    texts = [p.text for p in arithmetic_prompts(AR_DIR, 8)] + [humaneval_prompts(1)[0].text]
    return tokenizer, target, drafter, [tokenizer(t, return_tensors="pt").input_ids for t in texts]


def _deer(target, drafter, ids, **kwargs):
    return target.generate(ids, custom_generate=hf_dllm_spec.custom_generate, decoding_strategy="deer",
                           draft_model=drafter, max_new_tokens=40, **kwargs)


def test_drafter_shares_the_target_tokenizer_and_is_an_sdar_checkpoint(pair):
    from transformers import PreTrainedTokenizerFast

    tokenizer, _, drafter, _ = pair
    assert type(drafter).__name__ == "SDARForCausalLM" and drafter.config.mask_token_id == 2
    text = "def f(x):\n    return x + 12\nQuestion: Tom has 3 apples.\nAnswer:"
    assert PreTrainedTokenizerFast.from_pretrained(DRAFTER_DIR)(text).input_ids == tokenizer(text).input_ids


@pytest.mark.parametrize("k", [1, 4, 16])
def test_greedy_deer_equals_the_target_greedy_generate(pair, k):
    _, target, drafter, prompts = pair
    for ids in prompts[:3] + prompts[-1:]:
        assert torch.equal(_deer(target, drafter, ids, block_size=k),
                           target.generate(ids, max_new_tokens=40, do_sample=False))


def test_a_mask_id_in_the_target_config_leaves_deer_lossless(pair, monkeypatch):
    """An AR target whose generation config carries a `mask_token_id` (its first greedy token here): DEER still
    gives the target's greedy tokens (before: that id was suppressed from the target's distribution)."""
    _, target, drafter, prompts = pair
    ids = prompts[0]
    greedy = target.generate(ids, max_new_tokens=40, do_sample=False)
    monkeypatch.setattr(target.generation_config, "mask_token_id", int(greedy[0, ids.shape[1]]), raising=False)
    assert torch.equal(_deer(target, drafter, ids, block_size=4), greedy)


def test_candidate_generator_path_agrees(pair):
    _, target, drafter, prompts = pair
    for ids in (prompts[0], prompts[-1]):
        assisted = hf_dllm_spec.deer_assisted_generate(target, ids, drafter, num_draft_tokens=16, max_new_tokens=40,
                                                       do_sample=False)
        assert torch.equal(assisted, _deer(target, drafter, ids, block_size=16))


def test_batch_of_4_equals_singles(pair):
    tokenizer, target, drafter, prompts = pair
    tokenizer.padding_side = "left"
    texts = [tokenizer.decode(p[0]) for p in prompts[:3] + prompts[-1:]]
    enc = tokenizer(texts, return_tensors="pt", padding=True)
    batch = _deer(target, drafter, enc.input_ids, attention_mask=enc.attention_mask, block_size=8)
    for n, ids in enumerate(prompts[:3] + prompts[-1:]):
        single = _deer(target, drafter, ids, block_size=8)[0, ids.shape[1]:]
        assert torch.equal(batch[n, enc.input_ids.shape[1]:][: single.shape[0]], single)


def test_aligned_drafter_reaches_tau_4_at_k16_and_beats_the_unaligned_one(pair):
    """The issue's target (tau >= 4 at k = 16 on held-out arithmetic) on 8 problems; the benchmark has more."""
    _, target, drafter, prompts = pair
    _, unaligned = load(UNALIGNED_DIR)
    taus = {}
    for name, model in (("aligned", drafter), ("unaligned", unaligned)):
        stats = hf_dllm_spec.SpecDecodingStats()
        for ids in prompts[:8]:
            stats.merge(_deer(target, model, ids, block_size=16, return_dict_in_generate=True).spec_stats)
        taus[name] = stats.mean_acceptance_length
    assert taus["aligned"] >= 4.0, taus
    assert taus["aligned"] > taus["unaligned"], taus


def test_main_job_on_the_ar_target_runs_deer(capsys):
    from hf_dllm_spec import cli

    cli.main(["main", "--model", str(AR_DIR), "--num-arith", "2", "--num-humaneval", "1", "--max-new-tokens", "8",
              "--no-progress"])
    out = capsys.readouterr().out
    assert "| AR (block size 1) |" in out and "| DEER, k=16 |" in out
