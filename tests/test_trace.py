"""The runtime's per-forward trace (`hf_dllm_spec.runtime.trace`) against an independent observer: forward hooks on the
model see the same forwards, widths and context lengths, and the counts agree with the decoding statistics."""

from __future__ import annotations

import pytest
import torch

from hf_dllm_spec.outputs import FORWARD_KINDS
from hf_dllm_spec.runtime.trace import active_trace, trace_forwards
from model_patches.compat import find_cache


def hooked_forwards(model):
    """Record `(width, context)` of every model forward with a standard pre-hook; returns (records, handle)."""
    seen = []

    def hook(module, args, kwargs):
        cache = find_cache(kwargs)
        seen.append((int(kwargs["input_ids"].shape[1]), int(cache.get_seq_length()) if cache is not None else 0))

    return seen, model.register_forward_pre_hook(hook, with_kwargs=True)


@pytest.mark.parametrize("strategy,params", [("block_diffusion", {}), ("s2d2", {}), ("ar", {})])
def test_trace_matches_hooks_and_statistics(sdar_model, prompt, strategy, params):
    seen, handle = hooked_forwards(sdar_model)
    try:
        with trace_forwards(timed=True) as trace:
            out = sdar_model.generate(prompt, decoding_strategy=strategy, max_new_tokens=12, eos_token_id=None,
                                      return_dict_in_generate=True, **params)
    finally:
        handle.remove()
    records = trace.records
    assert [(r.width, r.context) for r in records] == seen
    stats = out.spec_stats
    assert len(records) == stats.num_forward_calls
    for kind in FORWARD_KINDS:
        assert sum(r.kind == kind for r in records) == getattr(stats, f"num_{kind}_forwards"), kind
    assert all(r.role == "target" and r.rows == 1 and r.seconds is not None and r.seconds >= 0 for r in records)
    assert records[0].kind == "prefill" and records[0].context == 0


def test_trace_is_off_outside_its_block(sdar_model, prompt):
    with trace_forwards() as trace:
        assert active_trace() is trace
    assert active_trace() is None
    sdar_model.generate(prompt, decoding_strategy="block_diffusion", max_new_tokens=4, eos_token_id=None)
    assert trace.records == []


def test_untimed_trace_has_no_seconds(sdar_model, prompt):
    with trace_forwards() as trace:
        sdar_model.generate(prompt, decoding_strategy="block_diffusion", max_new_tokens=4, eos_token_id=None)
    assert trace.records and all(r.seconds is None for r in trace.records)


def test_drafter_forwards_are_marked(sdar_model, prompt):
    """SimSD with a separate drafter: the drafter's forwards carry role "drafter", as the statistics count them."""
    with trace_forwards() as trace:
        out = sdar_model.generate(prompt, decoding_strategy="simsd", draft_model=sdar_model, max_new_tokens=8,
                                  eos_token_id=None, return_dict_in_generate=True)
    drafter = [r for r in trace.records if r.role == "drafter"]
    assert len(drafter) == out.spec_stats.num_draft_model_forwards > 0
    assert torch.is_tensor(out.sequences)
