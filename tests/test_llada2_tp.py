"""LLaDA2 under tensor parallelism (transformers' plan, `DistributedConfig(tp_plan="auto")`; docs/placement.md).

One `torchrun --standalone --nproc_per_node 2` run on the CPU (gloo) loads the bundled `models/llada2-tiny` sharded
(and `models/sdar-tiny-arith`, whose plan is Qwen3's) and, on every rank, compares every strategy of the family
(LLaDA2: `llada2` with token editing, `s2d2` with the LLaDA2.1 preset, `block_diffusion`) with the same call on the
unsharded model in the same process: batch 1 and a left-padded batch of 2, eager and static runtime
(`cache_implementation="static"`), greedy and seeded sampling (a `torch.Generator` seeded alike on every rank).
Tokens and per-row counters (NFE, committed, edited) must be equal; the weights must be DTensors and each rank's KV
cache must hold its own half of the K/V heads. Without processes: the plan's rules name real modules, and a layout
that cannot split is refused before any weight loads, naming the value, the rule and the fix.
"""

from __future__ import annotations

import json

import pytest
import torch

from hf_dllm_spec.tools.jobs.evaluation import ROOT
from model_patches.llada2 import (LLaDA2MoeConfig, LLaDA2MoeModelLM, check_parallel_sizes,
                                  resolved_parallel_layout)
from conftest import crash_report, run_torchrun

LLADA2_DIR = ROOT / "models" / "llada2-tiny"

#: Run by torchrun on each rank; writes `rank<r>.json` into the folder `argv[1]`: what was sharded, every case
#: that differed and the refusal message.
_SCRIPT = r'''
import json, os, sys
import torch, torch.distributed as dist
from dataclasses import fields
from transformers import AutoModelForCausalLM
from transformers.distributed import DistributedConfig

import hf_dllm_spec, model_patches
from model_patches.compat import output_cache
from hf_dllm_spec.tools.jobs.evaluation import ROOT, arithmetic_prompts, load
from hf_dllm_spec.tools.jobs.main import specs

TIMES = {"wall_time_s", "prefill_time_s", "forward_time_s", "draft_model_time_s", "warmup_time_s", "runtime"}
#: (model, rows, layout): tensor parallelism for both families, then LLaDA2's routed experts split by expert
#: (transformers >= 5.19: `ep_size`, with the rest tensor-parallel; 5.17 - 5.18: `enable_expert_parallel`, the
#: expert-parallel plan alone).
EXPERT_PARALLEL = (dict(tp_plan="auto", ep_size=2) if "ep_size" in DistributedConfig.__dataclass_fields__
                   else dict(tp_plan="auto", enable_expert_parallel=True))
#: The attention kept whole on every rank (docs/placement.md: the layout for more ranks than K/V heads).
WHOLE_ATTENTION = dict(tp_plan={"model.layers.*.attention.dense": "rowwise_split_input"})
#: Every row runs a left-padded batch of 2; the first row of each family a batch of 1 as well.
CASES = [("llada2-tiny", ["llada2", "s2d2-llada2", "dynamic"], dict(tp_plan="auto")),
         ("sdar-tiny-arith", ["ar", "dynamic", "s2d2"], dict(tp_plan="auto")),
         ("llada2-tiny", ["llada2"], EXPERT_PARALLEL), ("llada2-tiny", ["llada2"], WHOLE_ATTENTION)]
ALONE = {("llada2-tiny", "llada2"), ("sdar-tiny-arith", "ar")}


def counters(stats):
    return {f.name: getattr(stats, f.name) for f in fields(stats) if f.name not in TIMES}


def run(model, tokenizer, texts, spec, seed, **kwargs):
    tokenizer.padding_side = "left"
    enc = tokenizer(texts, return_tensors="pt", padding=True)
    sample = {} if seed is None else dict(do_sample=True, temperature=1.0, top_k=0,
                                           generator=torch.Generator().manual_seed(seed))
    out = model.generate(enc.input_ids, attention_mask=enc.attention_mask, decoding_strategy=spec.decoding_strategy,
                         return_dict_in_generate=True, max_new_tokens=12, **spec.params, **sample, **kwargs)
    return out.sequences.tolist(), [counters(s) for s in out.spec_stats_per_row]


hf_dllm_spec.register_auto_classes()
report = {"rank": dist.get_rank() if dist.is_initialized() else None, "differ": [], "checked": 0}
for name, rows, layout in CASES:
    path = ROOT / "models" / name
    tokenizer, plain = load(path)
    sharded = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                   distributed_config=DistributedConfig(**layout)).eval()
    report["rank"] = dist.get_rank()
    if layout is EXPERT_PARALLEL:
        experts = sharded.model.layers[-1].mlp.experts.gate_up_proj
        report["experts"] = [experts.to_local().shape[0], experts.shape[0]]
        name += " ep"
    if layout is WHOLE_ATTENTION:
        name += " whole attention"
    params = dict(sharded.named_parameters())
    report[name + " dtensors"] = sorted({k.split(".")[-2] if k.endswith("weight") else k.split(".")[-1]
                                         for k, p in params.items() if type(p).__name__ == "DTensor"})
    ids = tokenizer(arithmetic_prompts(path, 1)[0].text, return_tensors="pt").input_ids
    with torch.no_grad():
        cache = output_cache(sharded(ids, use_cache=True))
    report[name + " kv heads"] = [cache.layers[0].keys.shape[1], sharded.config.num_key_value_heads]
    patch = model_patches.get_patch(plain)
    texts = [p.text for p in arithmetic_prompts(path, 2)]
    for row in rows:
        (spec,) = specs(patch.trained_block_size(plain) or 4, 0.9, [row], {}, None, None)[-1:]
        for batch in ((texts[:1], texts) if (name, row) in ALONE else (texts,)):
            for runtime in ({}, {"cache_implementation": "static"}):
                for seed in (None, 3):
                    label = (f"{name} {row} batch={len(batch)} {'static' if runtime else 'eager'} "
                             f"{'seeded' if seed else 'greedy'}")
                    want = run(plain, tokenizer, batch, spec, seed, **runtime)
                    got = run(sharded, tokenizer, batch, spec, seed, **runtime)
                    report["checked"] += 1
                    if got != want:
                        report["differ"].append(label)
try:           # a layout that cannot split (1 K/V head on 2 ranks) is refused before any weight loads
    AutoModelForCausalLM.from_pretrained(ROOT / "models" / "llada2-tiny", num_key_value_heads=1,
                                         distributed_config=DistributedConfig(tp_plan="auto"))
except ValueError as error:
    report["refused"] = str(error)
with open(os.path.join(sys.argv[1], f"rank{dist.get_rank()}.json"), "w") as out:
    json.dump(report, out)
'''


@pytest.mark.slow
def test_tensor_parallel_llada2_and_sdar_give_the_single_process_tokens(tmp_path):
    """2 CPU ranks over gloo: every LLaDA2 / SDAR strategy, a left-padded batch of 2 (and batch 1 for one row per
    family), eager and static, greedy and seeded."""
    if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
        pytest.skip("needs torch.distributed with gloo")
    script = tmp_path / "tp_llada2.py"
    script.write_text(_SCRIPT)
    done = run_torchrun(script, str(tmp_path), timeout=900)
    assert done.returncode == 0, crash_report(done)
    reports = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    assert [r["rank"] for r in reports] == [0, 1]
    for report in reports:
        assert report["differ"] == [] and report["checked"] == (3 + 3 + 1 + 1 + 2) * 2 * 2, report
        assert report["experts"] == [4, 8]                        # expert parallel: each rank runs 4 of the 8
        assert report["llada2-tiny whole attention kv heads"] == [2, 2]
        assert "dense" in report["llada2-tiny whole attention dtensors"]
        assert report["refused"].startswith("`num_key_value_heads` (=1) must be a multiple of the tensor-parallel"), \
            report
        assert report["llada2-tiny kv heads"] == [1, 2]           # each rank caches its own K/V head
        assert report["sdar-tiny-arith kv heads"][0] * 2 == report["sdar-tiny-arith kv heads"][1]
        assert {"query_key_value", "dense", "gate_up_proj", "down_proj", "gate_proj", "up_proj", "lm_head",
                "word_embeddings"} <= set(report["llada2-tiny dtensors"]), report


# -- without processes ----------------------------------------------------------------------------------------------
def _tiny(**overrides) -> LLaDA2MoeConfig:
    base = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2, n_group=2, topk_group=1,
                moe_intermediate_size=16, num_shared_experts=1, pad_token_id=0, eos_token_id=1)
    return LLaDA2MoeConfig(**{**base, **overrides})


def test_plan_rules_name_real_modules_and_parameters():
    """Every rule of the LM's plan (config `base_model_tp_plan` + `_tp_plan`) matches a module or parameter."""
    model = LLaDA2MoeModelLM(_tiny())
    names = {n for n, _ in model.named_modules()} | {n for n, _ in model.named_parameters()}
    generic = {".".join("*" if part.isdigit() else part for part in n.split(".")) for n in names}
    plan = model._tp_plan
    assert plan["lm_head"] == "colwise_gather_output"
    assert plan["model.layers.*.attention.dense"] == "rowwise"
    assert not any("mlp.gate" == key.rsplit(".", 1)[-1] or key.endswith("mlp.gate") for key in plan)  # replicated
    assert set(plan) <= generic, set(plan) - generic
    assert set(model._ep_plan) <= generic, set(model._ep_plan) - generic


class _Distributed:
    """Stands for a `DistributedConfig` of either transformers generation."""

    def __init__(self, **fields_):
        self.__dict__.update(fields_)


@pytest.mark.parametrize("overrides,tp,ep,name,value", [
    (dict(num_attention_heads=6, num_key_value_heads=2), 4, 1, "num_attention_heads", 6),
    (dict(num_attention_heads=6, num_key_value_heads=3), 2, 1, "num_key_value_heads", 3),
    (dict(num_key_value_heads=4, moe_intermediate_size=18), 4, 1, "moe_intermediate_size", 18),
    (dict(num_experts=6, n_group=3), 1, 4, "num_experts", 6),
])
def test_a_layout_that_cannot_split_is_refused_naming_value_rule_and_fix(overrides, tp, ep, name, value):
    model = LLaDA2MoeModelLM(_tiny(**overrides))
    plan, tp_size, ep_size = resolved_parallel_layout(model, _Distributed(tp_size=tp, ep_size=ep, tp_plan="auto"))
    with pytest.raises(ValueError) as info:
        check_parallel_sizes(model.config, plan, tp_size, ep_size)
    message = str(info.value)
    assert f"`{name}` (={value}) must be a multiple of the" in message and f", {max(tp, ep)} here" in message
    assert "--nproc_per_node" in message and 'device_map="auto"' in message


def test_what_the_plan_does_not_shard_is_not_refused():
    """6 heads on 4 ranks is fine when the attention rules are dropped (`tp_plan` dict), and with the legacy
    expert-parallel flag (transformers 5.17 - 5.18: the EP plan alone) only `num_experts` counts."""
    model = LLaDA2MoeModelLM(_tiny(num_attention_heads=6, num_key_value_heads=2, moe_intermediate_size=18))
    plan, tp_size, ep_size = resolved_parallel_layout(model, _Distributed(tp_size=4, ep_size=4, tp_plan={
        "model.layers.*.attention.dense": "rowwise_split_input"}))
    check_parallel_sizes(model.config, plan, tp_size, ep_size)
    plan, tp_size, ep_size = resolved_parallel_layout(model, _Distributed(tp_size=4, tp_plan="auto",
                                                                          enable_expert_parallel=True))
    assert ep_size == 4 and not any(key.endswith("attention.dense") for key in plan)
    check_parallel_sizes(model.config, plan, tp_size, ep_size)


def test_the_check_runs_in_transformers_sharding_step():
    """`from_pretrained(distributed_config=...)` calls `maybe_distribute_model` on the empty model, before loading."""
    from transformers.distributed import DistributedConfig

    model = LLaDA2MoeModelLM(_tiny(num_attention_heads=6, num_key_value_heads=3))
    with pytest.raises(ValueError, match=r"`num_key_value_heads` \(=3\) must be a multiple of the tensor-parallel"):
        LLaDA2MoeModelLM.maybe_distribute_model(model, DistributedConfig(tp_size=2, tp_plan="auto"), None)
    assert LLaDA2MoeModelLM.maybe_distribute_model(model, None, None) is model


def test_head_group_is_all_heads_without_tensor_parallelism():
    model = LLaDA2MoeModelLM(_tiny())
    assert model.model.layers[0].attention.head_group == (0, 1)
