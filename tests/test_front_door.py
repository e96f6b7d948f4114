"""The front door (issue 33): one plan per call, greedy means greedy, and the one bridge to transformers' private
behaviour, each piece exercised on the installed transformers (CI runs this file on the newest and the oldest
supported release)."""

from __future__ import annotations

import dataclasses
import inspect
import pathlib
from types import SimpleNamespace

import pytest
import torch
from transformers import CompileConfig, GenerationConfig, StaticCache, TextStreamer

import hf_dllm_spec
from hf_dllm_spec import bridge
from hf_dllm_spec.integration.plan import DecodePlan, build_plan

ROOT = pathlib.Path(__file__).resolve().parents[1]


# -- the plan --------------------------------------------------------------------------------------------------------
def test_the_plan_holds_every_resolved_fact_and_is_frozen(sdar_model, prompt):
    config = GenerationConfig(max_new_tokens=8, eos_token_id=None)
    plan = build_plan(sdar_model, prompt, config, {}, decoding_strategy="s2d2", overrides={}, strategy_config=None,
                      preset=None, draft_model=None, mask_token_id=None, draft_mask_token_id=None, generator=None,
                      streamer=None, stopping_criteria=None)
    assert isinstance(plan, DecodePlan)
    assert plan.block_size == plan.config.block_size == 4            # the checkpoint's, written into the config
    assert (plan.mask_token_id, plan.max_new_tokens, plan.lengths, plan.static) == (98, 8, (7,), False)
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.block_size = 8


def test_block_size_is_checked_once_against_the_strategy_parameters(sdar_model, prompt):
    with pytest.raises(ValueError, match="steps_per_block"):
        sdar_model.generate(prompt, decoding_strategy="block_diffusion", steps_per_block=8, max_new_tokens=4)
    with pytest.raises(ValueError, match="sub_block_size"):
        sdar_model.generate(prompt, decoding_strategy="block_diffusion", sub_block_size=3, max_new_tokens=4)


# -- greedy means greedy -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("strategy,parameter,value", [("s2d2", "s2d2_acceptance", "stochastic")])
def test_a_random_acceptance_rule_under_greedy_needs_a_generator(sdar_model, prompt, monkeypatch, strategy,
                                                                 parameter, value):
    """`do_sample=False` with rejection sampling of the drafts drew random numbers from torch's global generator:
    other tokens per seed. Refused before any forward; with an explicit generator it is the reference code's mode,
    reproducible."""
    forward = sdar_model.forward
    calls = []
    monkeypatch.setattr(sdar_model, "forward", lambda *a, **k: calls.append(1) or forward(*a, **k))
    common = dict(decoding_strategy=strategy, max_new_tokens=8, eos_token_id=None, **{parameter: value})
    with pytest.raises(ValueError, match=rf"`{parameter}` \(='{value}'\) must come with do_sample=True") as info:
        sdar_model.generate(prompt, **common)
    assert "generator=torch.Generator" in str(info.value) and not calls
    runs = [sdar_model.generate(prompt, generator=torch.Generator().manual_seed(5), **common) for _ in range(2)]
    assert runs[0].tolist() == runs[1].tolist()


def test_drafter_rejection_sampling_under_greedy_needs_a_generator(sdar_model, prompt):
    with pytest.raises(ValueError, match=r"`acceptance` \(='rejection_sampling'\) must come with do_sample=True"):
        sdar_model.generate(prompt, decoding_strategy="simsd", draft_model=sdar_model, acceptance="rejection_sampling",
                            max_new_tokens=8, eos_token_id=None)


# -- the bridge, on the installed transformers -------------------------------------------------------------------------
def test_bridge_reads_the_generate_call_that_invoked_the_callable(sdar_model, prompt):
    """`streamer`, `tokenizer`, `assistant_model` and the raw mask, which transformers drops for a callable."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(ROOT / "models" / "sdar-tiny-arith")
    seen = {}

    def callable_(model, input_ids, *args, **kwargs):
        seen.update(bridge.generate_call_arguments(model))
        return input_ids

    streamer = TextStreamer(tokenizer)
    mask = torch.ones_like(prompt)
    bridge.generate_with_callable(sdar_model, prompt, attention_mask=mask, custom_generate=callable_,
                                  streamer=streamer, tokenizer=tokenizer, max_new_tokens=2)
    assert seen["streamer"] is streamer and seen["tokenizer"] is tokenizer and seen["attention_mask"] is mask
    assert bridge.generate_call_arguments(sdar_model) == {}                     # no generate call around
    assert bridge.caller_stacklevel() >= 1


def test_bridge_routes_the_keywords_a_signature_names(sdar_model, prompt):
    def callable_(model, input_ids, logits_processor=None, stopping_criteria=None, generation_config=None,
                  synced_gpus=False, streamer=None, **kwargs):
        return torch.cat([input_ids, torch.full((1, 1), int(kwargs["my_gain"]))], dim=1)

    base = inspect.signature(callable_)
    with pytest.raises(ValueError, match="my_gain"):                          # transformers refuses it ...
        bridge.generate_with_callable(sdar_model, prompt, custom_generate=callable_, my_gain=7)
    bridge.route_keywords(callable_, base, ["my_gain"], None)                  # ... until the signature names it
    out = bridge.generate_with_callable(sdar_model, prompt, custom_generate=callable_, my_gain=7)
    assert out[0, -1].item() == 7


@pytest.mark.parametrize("options", [dict(), dict(disable_compile=True), dict(all_devices=True),
                                     dict(all_devices=True, quantizer=False), dict(all_devices=True, offload=True)])
def test_bridge_compile_rule_equals_transformers_own(sdar_model, monkeypatch, options):
    """`transformers_compiles` against `GenerationMixin._valid_auto_compile_criteria` itself, with a static cache."""
    compile_config = None
    if options.get("all_devices"):
        compile_config = CompileConfig()
        compile_config._compile_all_devices = True
    config = GenerationConfig(compile_config=compile_config, disable_compile=options.get("disable_compile", False))
    if "quantizer" in options:
        monkeypatch.setattr(sdar_model, "hf_quantizer", SimpleNamespace(is_compileable=options["quantizer"]),
                            raising=False)
    if options.get("offload"):
        monkeypatch.setattr(sdar_model, "hf_device_map", {"model.embed_tokens": "cpu", "model.layers.0": "disk"},
                            raising=False)
    cache = StaticCache(config=sdar_model.config, max_cache_len=16)
    theirs = sdar_model._valid_auto_compile_criteria({"cache": cache, "past_key_values": cache}, config)
    ours, reason = bridge.transformers_compiles(sdar_model, config, torch.device("cpu"))
    assert ours == bool(theirs) and (reason == "") == ours


def test_bridge_tells_the_cache_generate_prepared(sdar_model, prompt):
    from model_patches.compat import find_cache

    seen = {}

    def callable_(model, input_ids, *args, **kwargs):
        seen["cache"] = find_cache(kwargs)
        return input_ids

    bridge.generate_with_callable(sdar_model, prompt, custom_generate=callable_, cache_implementation="static",
                                  max_new_tokens=2)
    assert isinstance(seen["cache"], StaticCache) and bridge.prepared_by_generate(seen["cache"])


def test_frames_are_read_in_one_module_only():
    """No module of the package but the bridge reads frames or the signature of transformers' generate."""
    package = pathlib.Path(hf_dllm_spec.__file__).parent
    for path in package.rglob("*.py"):
        if path.name == "bridge.py":
            continue
        text = path.read_text()
        for needle in ("currentframe", "f_back", "f_locals", "__signature__", "_valid_auto_compile_criteria(",
                       "_getframe"):
            assert needle not in text, f"{path.relative_to(package)} uses {needle}"
