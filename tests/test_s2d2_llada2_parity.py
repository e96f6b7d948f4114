"""S2D2 on LLaDA2: the routing semantics behind the differences from the S2D2 reference loop (issue 38).

A parity harness (issue 38's note) ran the library and the authors' `LLaDA2/generate_utils.py::generate_ssd_policy`
on a grid of routing policies x estimators x seeds x prompt lengths; every difference came from one of two
deliberate choices of the library, pinned here on the library's side:

- routing is consulted only on a step with a mask span to verify: on LLaDA2.1's editing-only post steps
  (`max_post_steps` >= 1) no policy decides, so a hysteresis switch keeps its state across the block boundary
  (Algorithm 4: the state persists for the whole generation). The reference scores the empty span -inf there,
  which switches its hysteresis OFF at the end of every block;
- hysteresis turns on at s >= tau_on (Algorithm 4; the reference uses >): `test_masks_unmasking_routing.py`.

Tiny random LLaDA2 MoE from config (conftest `llada2_model`, block size 4, mask 98), fp32, CPU.
"""

from __future__ import annotations

import pytest
import torch
from conftest import gen

from hf_dllm_spec.maths.routing import HysteresisPolicy
from hf_dllm_spec.strategies.s2d2 import S2D2Strategy

B = 4
PROMPT = torch.tensor([5, 17, 42, 8, 23, 61, 4])          # one block prefilled, a tail of 3 in the first block
# Found by a search on the tiny model: the switch turns on inside a block and is still on when the editing-only
# post steps run; static score, c = 1, so s = K_hat - 1 and the Renyi estimates put s near -0.97.
ON, OFF = -0.97, -2.0
HYSTERESIS = dict(do_verify_policy="score_hysteresis", hysteresis_threshold_on=ON, hysteresis_threshold_off=OFF,
                  do_verify_score_type="difference_static", score_penalty_coef=1.0,
                  token_acceptance_estimator="soft_renyi_2_entropy", s2d2_acceptance="stochastic",
                  confidence_threshold=0.6, editing_threshold=0.1, max_post_steps=2, num_to_transfer=1)


@pytest.fixture
def trace(monkeypatch):
    """Log of the run: ("post",) for each step whose block has no mask left, ("route", span, score, on before,
    verify) for each policy decision."""
    log = []
    decide, step = HysteresisPolicy.decide, S2D2Strategy.denoise_step

    def logged_decide(self, ctx):
        before = self.on
        verify = decide(self, ctx)
        log.append(("route", ctx.span_length, ctx.score, before, verify))
        return verify

    def logged_step(self, block, logits):
        if not bool(block.masked.any()):
            log.append(("post",))
        return step(self, block, logits)

    monkeypatch.setattr(HysteresisPolicy, "decide", logged_decide)
    monkeypatch.setattr(S2D2Strategy, "denoise_step", logged_step)
    return log


def carried_decisions(log):
    """Decisions of the first routed step after editing-only post steps entered with the switch on."""
    out, on_at_post, previous = [], False, None
    for event in log:
        if event[0] == "post":
            on_at_post = on_at_post or (previous is not None and previous[4])
            continue
        if on_at_post:
            out.append(event)
        on_at_post, previous = False, event
    return out


def test_hysteresis_state_crosses_editing_only_post_steps(llada2_model, trace):
    out = llada2_model.generate(PROMPT[None], decoding_strategy="s2d2", block_size=B, max_new_tokens=16,
                                generator=gen(93), return_dict_in_generate=True, **HYSTERESIS)
    routes = [e for e in trace if e[0] == "route"]
    assert any(e[0] == "post" for e in trace) and out.spec_stats.num_edited_tokens > 0
    assert all(span > 0 for _, span, _, _, _ in routes)           # no policy decides on an empty span
    carried = carried_decisions(trace)
    assert carried and all(on_before for _, _, _, on_before, _ in carried)    # the post steps left the switch on
    # ... and it decided a step: a score below tau_on (an OFF switch would not verify) verified.
    assert any(OFF <= score < ON and verify for _, _, score, _, verify in carried)
    assert out.spec_stats.num_verify_forwards == sum(verify for *_, verify in routes)


def test_without_post_steps_no_step_goes_unrouted(llada2_model, trace):
    """With `max_post_steps=0` (the S2D2 CLI's and the library presets' LLaDA2.1 setting) a block ends at its last
    mask: no editing-only step runs, so the reference's reset has nothing to act on (the harness found no
    difference there beyond the turn-on comparison)."""
    llada2_model.generate(PROMPT[None], decoding_strategy="s2d2", block_size=B, max_new_tokens=16,
                          generator=gen(93), **{**HYSTERESIS, "max_post_steps": 0})
    assert trace and not any(e[0] == "post" for e in trace)
