"""Per-row randomness: `generate(..., generator=[g_0, .., g_{N-1}])` gives each row of a sampled batch the tokens of
its prompt decoded alone with its own generator.

Every strategy on its bundled model(s) (sampled, temperature 1), a left-padded batch of 3 prompts of different
lengths with a stop id that ends rows at different steps (finished rows leave the batch and take their generator
along), compared token for token with each prompt decoded alone with a fresh generator of the same seed; other
seeds give other tokens. The draw helpers are checked against row-by-row draws, and the shared-generator stream
against the plain torch calls it always made.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import hf_dllm_spec
from hf_dllm_spec.tools.jobs.evaluation import ROOT, load
from hf_dllm_spec.maths.sampling import RowGenerators, draw_categorical, draw_uniforms, rows_of
from hf_dllm_spec.maths.verification import rejection_sample

MODELS = ROOT / "models"
TEXTS = ["Q: 3 + 4 =", "Question: Tom has 12 apples and eats", "1"]
SEEDS = [1, 2, 3]
MAX_NEW_TOKENS = 8

#: strategy id -> (strategy, target, drafter, parameters): each strategy on the bundled model(s) it runs on.
CASES = {
    "ar": ("ar", "sdar-tiny-arith", None, {}),
    "block_diffusion": ("block_diffusion", "sdar-tiny-arith", None, {"confidence_threshold": 0.5}),
    "s2d2": ("s2d2", "sdar-tiny-arith", None, {"min_ssd_span_length": 1}),
    # blocks of 8 instead of the trained 32: the same code paths in fewer forwards
    "fast_dllm_v2": ("fast_dllm_v2", "fast-dllm-v2-tiny", None, {"block_size": 8, "sub_block_size": 4}),
    # separate cache writes on a right-shifted model: a block's first token is drawn from the carry
    "fast_dllm_v2-separate-writes": ("fast_dllm_v2", "fast-dllm-v2-tiny", None,
                                     {"block_size": 8, "sub_block_size": 4, "fuse_cache_write": False}),
    "llada2": ("llada2", "llada2-tiny", None, {"block_size": 8}),
    "simsd": ("simsd", "sdar-large", "sdar-tiny-arith", {}),
    "deer": ("deer", "qwen2-tiny-ar", "deer-drafter-tiny", {"block_size": 4}),
}
#: Strategies whose draws at batch size 1 are the same with `generator=g` and `generator=[g]` (SimSD's shared
#: generator draws one uniform per block position, a row's own generator one per draft: sampling.py).
SAME_AS_SHARED = {name for name in CASES if name != "simsd"}

_LOADED: dict = {}


def _load(name: str):
    if name not in _LOADED:
        _LOADED[name] = load(MODELS / name)
    return _LOADED[name]


def _generate(case: str, texts: list[str], generator, eos=None) -> torch.Tensor:
    """The new tokens of each row of a left-padded batch of `texts` (pad ids after a row's end)."""
    strategy, target, drafter, params = CASES[case]
    tokenizer, model = _load(target)
    extra = {"draft_model": _load(drafter)[1]} if drafter else {}
    if not isinstance(model, hf_dllm_spec.DllmGenerationMixin):
        extra["custom_generate"] = hf_dllm_spec.custom_generate
    tokenizer.padding_side = "left"
    enc = tokenizer(texts, return_tensors="pt", padding=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = model.generate(enc.input_ids, attention_mask=enc.attention_mask, decoding_strategy=strategy,
                             max_new_tokens=MAX_NEW_TOKENS, do_sample=True, temperature=1.0, top_k=0,
                             eos_token_id=eos, pad_token_id=tokenizer.pad_token_id, generator=generator,
                             **params, **extra)
    return out[:, enc.input_ids.shape[1]:]


def _gens(seeds) -> list[torch.Generator]:
    return [torch.Generator().manual_seed(s) for s in seeds]


def _ended(tokens: torch.Tensor, eos: int) -> torch.Tensor:
    """A row's tokens up to and including its first `eos`."""
    hits = (tokens == eos).nonzero()
    return tokens if hits.numel() == 0 else tokens[: int(hits[0, 0]) + 1]


@pytest.mark.parametrize("case", list(CASES))
def test_sampled_batch_with_per_row_generators_equals_each_prompt_alone(case, one_thread):
    # A stop id that row 0 really samples at its third token: rows end at different steps and leave the batch.
    eos = int(_generate(case, TEXTS[:1], _gens(SEEDS[:1]))[0, 2])
    singles = [_ended(_generate(case, [text], _gens([seed]), eos)[0], eos) for text, seed in zip(TEXTS, SEEDS)]
    batch = _generate(case, TEXTS, _gens(SEEDS), eos)
    for i, single in enumerate(singles):
        assert batch[i, : single.shape[0]].tolist() == single.tolist(), f"row {i}"
    assert len({s.shape[0] for s in singles}) > 1, "rows should end at different steps"
    if case in SAME_AS_SHARED:          # batch size 1: a list of one generator draws what the generator alone draws
        alone = _ended(_generate(case, TEXTS[1:2], torch.Generator().manual_seed(SEEDS[1]), eos)[0], eos)
        assert alone.tolist() == singles[1].tolist()
    # Other seeds, other tokens (the comparison above can fail), and a row's tokens follow its own seed only.
    other = _generate(case, TEXTS, _gens([SEEDS[0], 50, 60]), eos)
    assert other[0, : singles[0].shape[0]].tolist() == singles[0].tolist()
    assert not torch.equal(other[1:], batch[1:])


# -- the draws -------------------------------------------------------------------------------------------------------
def test_draw_categorical_per_row_equals_each_row_drawn_alone():
    probs = torch.softmax(torch.randn(3, 4, 11, generator=torch.Generator().manual_seed(0)), dim=-1)
    draw = torch.tensor([[True, True, False, False], [False] * 4, [True] * 4])
    tokens = draw_categorical(probs, RowGenerators(_gens([5, 6, 7])), draw)
    for r, seed in enumerate([5, 6, 7]):
        alone = draw_categorical(probs[r:r + 1, draw[r]], torch.Generator().manual_seed(seed))
        assert tokens[r, draw[r]].tolist() == alone[0].tolist()
        assert tokens[r, ~draw[r]].tolist() == probs[r, ~draw[r]].argmax(-1).tolist()    # no draw: the argmax
    # a row without draws consumes nothing from its generator
    generators = RowGenerators(_gens([5, 6, 7]))
    draw_categorical(probs, generators, draw)
    assert torch.equal(generators[1].get_state(), torch.Generator().manual_seed(6).get_state())


def test_shared_generator_stream_is_unchanged():
    """One generator for the batch: the single torch calls of earlier versions, whatever `draw` says."""
    probs = torch.softmax(torch.randn(2, 3, 7, generator=torch.Generator().manual_seed(1)), dim=-1)
    expected = torch.multinomial(probs.reshape(-1, 7), 1, generator=torch.Generator().manual_seed(4)).reshape(2, 3)
    got = draw_categorical(probs, torch.Generator().manual_seed(4), torch.zeros(2, 3, dtype=torch.bool))
    assert torch.equal(got, expected)
    uniforms = draw_uniforms(torch.tensor([1, 3]), 3, torch.Generator().manual_seed(4), device=torch.device("cpu"),
                             dtype=torch.float32)
    assert torch.equal(uniforms, torch.rand(2, 3, generator=torch.Generator().manual_seed(4)))


@pytest.mark.parametrize("bonus", [False, True])
def test_rejection_sample_per_row_equals_each_row_verified_alone(bonus):
    g = torch.Generator().manual_seed(2)
    n, length, vocab = 5, 4, 6
    draft_probs = torch.softmax(torch.randn(n, length, vocab, generator=g), dim=-1)
    target_probs = torch.softmax(torch.randn(n, length, vocab, generator=g), dim=-1)
    drafts = torch.multinomial(draft_probs.reshape(-1, vocab), 1, generator=g).reshape(n, length)
    bonus_probs = torch.softmax(torch.randn(n, vocab, generator=g), dim=-1) if bonus else None
    num_drafts = torch.tensor([4, 0, 2, 3, 1])
    seeds = [10, 11, 12, 13, 14]
    batch = rejection_sample(drafts, draft_probs, target_probs, num_drafts=num_drafts, bonus_probs=bonus_probs,
                             generator=RowGenerators(_gens(seeds)))
    assert bool(batch.recovered.any())                        # rejections happen, so the residual draw is checked
    for r, seed in enumerate(seeds):
        k = int(num_drafts[r])                                # alone, a row's drafts are all it has
        alone = rejection_sample(drafts[r:r + 1, :k], draft_probs[r:r + 1, :k], target_probs[r:r + 1, :k],
                                 bonus_probs=None if bonus_probs is None else bonus_probs[r:r + 1],
                                 generator=torch.Generator().manual_seed(seed))
        assert batch.row(r).tolist() == alone.row(0).tolist(), f"row {r}"


def test_row_generators_follow_their_rows():
    generators = RowGenerators(_gens([1, 2, 3, 4]))
    ids = [id(generators[i]) for i in range(4)]
    assert [id(g) for g in rows_of(generators, torch.tensor([3, 1])).generators] == [ids[3], ids[1]]
    generators.select(torch.tensor([0, 2, 3]))
    generators.select([2, 0])
    assert [id(g) for g in generators.generators] == [ids[3], ids[0]]
    shared = torch.Generator()
    assert rows_of(shared, [1]) is shared and rows_of(None, [1]) is None
    with pytest.raises(ValueError, match="per-row generators for 2 rows"):
        draw_categorical(torch.full((2, 3), 1 / 3), RowGenerators(_gens([1])))
