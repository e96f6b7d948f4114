"""Drafts you can watch: transformers' `TextDiffusionStreamer` protocol (`put_draft` for provisional tokens, `put`
for committed ones, `end`) with every block strategy in `generate`, batch 1, on the bundled models (greedy).

A draft must never change decoding, the committed tokens must be exactly the returned ones, and without token
editing or a separate drafter a draft's decided tokens are the final tokens at their positions (a committed token
is never revised).
"""

from __future__ import annotations

import pathlib
import re

import pytest
from transformers import TextDiffusionStreamer

from conftest import Recorder

import model_patches
from hf_dllm_spec.tools.jobs.evaluation import load
from hf_dllm_spec.integration.generate import dllm_generate
from hf_dllm_spec.integration.mixin import DllmGenerationMixin
from hf_dllm_spec.strategies.registry import resolve_config

MODELS = pathlib.Path(__file__).resolve().parents[1] / "models"
PROMPT = "Question: Tom has 12 apples. Tom gets 7 more apples. How many apples does Tom have now?\nAnswer:"


_loaded: dict[str, tuple] = {}


def bundled(name: str):
    if name not in _loaded:
        _loaded[name] = load(MODELS / name)
    return _loaded[name]


def run(model, tokenizer, strategy: str, streamer=None, drafter=None, max_new_tokens: int = 16, **kwargs):
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    entry = {} if isinstance(model, DllmGenerationMixin) else {"custom_generate": dllm_generate}
    if drafter is not None:
        kwargs["draft_model"] = drafter
    out = model.generate(ids, decoding_strategy=strategy, max_new_tokens=max_new_tokens, streamer=streamer,
                         return_dict_in_generate=True, **entry, **kwargs)
    return out.sequences[0, ids.shape[1]:][: out.spec_stats_per_row[0].num_generated_tokens].tolist()


# (model, drafter, strategy, parameters, how the commits after a draft relate to it): "prefix", the committed
# tokens are a prefix of the draft just shown (greedy diffusion steps commit the argmax the draft showed); "drafts",
# all but the last (a drafter's accepted proposals, then the target's own token); None, no relation (token
# editing revises, SimSD's target re-decides the rest of the block).
CASES = [
    pytest.param("sdar-tiny-arith", None, "block_diffusion", {"block_size": 4}, "prefix", id="block_diffusion"),
    pytest.param("sdar-tiny-arith", None, "s2d2", {}, "drafts", id="s2d2"),
    pytest.param("fast-dllm-v2-tiny", None, "fast_dllm_v2", {}, "prefix", id="fast_dllm_v2"),
    pytest.param("llada2-tiny", None, "llada2", {}, None, id="llada2.1-editing"),
    pytest.param("llada2-tiny", None, "llada2", {"preset": "llada2.0"}, "prefix", id="llada2.0"),
    pytest.param("qwen2-tiny-ar", "deer-drafter-tiny", "deer", {}, "drafts", id="deer"),
    pytest.param("sdar-large", "sdar-tiny-arith", "simsd", {}, None, id="simsd", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("name, drafter, strategy, params, relation", CASES)
def test_drafts_then_commits_with_every_block_strategy(one_thread, name, drafter, strategy, params, relation):
    tokenizer, model = bundled(name)
    draft_model = bundled(drafter)[1] if drafter else None
    want = run(model, tokenizer, strategy, drafter=draft_model, **params)
    recorder = Recorder()
    assert run(model, tokenizer, strategy, recorder, drafter=draft_model, **params) == want   # drafts change nothing
    kinds = [kind for kind, _ in recorder.events]
    assert kinds[0] == "put" and kinds[-1] == "end" and kinds.count("end") == 1   # the prompt first, end() last
    committed, drafts, shown = [], 0, None
    block = model_patches.get_patch(model).trained_block_size(model) or resolve_config(strategy).block_size
    for kind, tokens in recorder.events[1:-1]:
        if kind == "draft":
            drafts += 1
            assert 0 < len(tokens) <= min(block, 16 - len(committed))        # within the block and the budget
            shown = tokens
            continue
        committed += tokens
        if shown is not None and relation is not None:
            kept = tokens if relation == "prefix" else tokens[:-1]
            assert shown[: len(kept)] == kept, (shown, tokens)
        shown = None
    assert committed == want
    assert drafts > 0


def test_ar_sends_no_drafts(one_thread):
    tokenizer, model = bundled("sdar-tiny-arith")
    recorder = Recorder()
    assert run(model, tokenizer, "ar", recorder, max_new_tokens=6) == run(model, tokenizer, "ar", max_new_tokens=6)
    assert "draft" not in [kind for kind, _ in recorder.events]


def test_no_draft_follows_a_stop_string_cut(one_thread):
    """A stop string that ends the row inside a block: its final tokens are put, then `end()`, with no draft
    between (the block's later steps still showed drafts of tokens after the cut)."""
    tokenizer, model = bundled("sdar-tiny-arith")
    ids = tokenizer("12+34=", return_tensors="pt").input_ids
    free = model.generate(ids, decoding_strategy="block_diffusion", max_new_tokens=16)[0, ids.shape[1]:].tolist()
    recorder = Recorder()
    cut = model.generate(ids, decoding_strategy="block_diffusion", max_new_tokens=16, streamer=recorder,
                         stop_strings=[tokenizer.decode(free[2:4])], tokenizer=tokenizer)[0, ids.shape[1]:].tolist()
    assert len(cut) < len(free) and free[: len(cut)] == cut
    kinds = [kind for kind, _ in recorder.events]
    assert "draft" in kinds
    last_put = max(i for i, kind in enumerate(kinds) if kind == "put")
    assert kinds[last_put + 1:] == ["end"], recorder.events


def test_text_diffusion_streamer_prints_drafts_then_the_returned_text(one_thread, capsys):
    """transformers' own `TextDiffusionStreamer`: drafts are printed and erased (ANSI save / restore-and-clear);
    what stays on the terminal is the returned text."""
    tokenizer, model = bundled("sdar-tiny-arith")
    want = run(model, tokenizer, "block_diffusion", block_size=4)
    streamer = TextDiffusionStreamer(tokenizer, skip_prompt=True)
    assert run(model, tokenizer, "block_diffusion", streamer, block_size=4) == want
    out = capsys.readouterr().out
    assert "\x1b7" in out                                        # at least one draft was shown
    kept = re.sub(r"\x1b7.*?\x1b8\x1b\[J", "", out, flags=re.S)  # drop each draft with its erasure
    assert kept == tokenizer.decode(want) + "\n"


def test_a_streamer_asking_for_draft_logits_is_refused_before_any_forward(one_thread):
    tokenizer, model = bundled("sdar-tiny-arith")
    streamer = Recorder()
    streamer._takes_logits = True
    with pytest.raises(ValueError, match=r"`streamer` \(='Recorder'\) must not ask for draft logits"):
        run(model, tokenizer, "block_diffusion", streamer)
