"""Loading an SDAR checkpoint in the Hub layout, both `generate` entry points, bad input, statistics."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from conftest import MASK_ID, TINY, gen, tiny_family_models
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, GenerationConfig

import hf_dllm_spec
from hf_dllm_spec import S2D2Config
from model_patches.sdar import SDARForCausalLM

HUB_PARAM_NAMES = [
    "model.embed_tokens.weight", "model.norm.weight", "lm_head.weight",
    *[f"model.layers.{i}.{name}.weight" for i in range(2) for name in (
        "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "self_attn.q_norm",
        "self_attn.k_norm", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "input_layernorm",
        "post_attention_layernorm")],
]


@pytest.fixture(scope="module")
def hub_checkpoint(tmp_path_factory, sdar_model):
    """A directory written by hand in the Hub SDAR layout (config keys, names, safetensors, eos list)."""
    path = tmp_path_factory.mktemp("sdar_hub")
    config = {
        "architectures": ["SDARForCausalLM"], "model_type": "sdar",
        "auto_map": {"AutoConfig": "configuration_sdar.SDARConfig", "AutoModel": "modeling_sdar.SDARModel",
                     "AutoModelForCausalLM": "modeling_sdar.SDARForCausalLM"},
        "attn_implementation": "flex_attention", "fuse_cross_entropy": True, "use_cache": False,
        "block_size": 4, "mask_token_id": MASK_ID, "hidden_act": "silu", "rms_norm_eps": 1e-6,
        "rope_theta": 10_000.0, "attention_bias": False, "tie_word_embeddings": False,
        "torch_dtype": "float32", "bos_token_id": 0, "eos_token_id": 1,
        **{k: v for k, v in TINY.items() if k not in ("attn_implementation", "eos_token_id", "bos_token_id",
                                                       "pad_token_id", "initializer_range")},
    }
    (path / "config.json").write_text(json.dumps(config))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [96, 97], "pad_token_id": 97}))
    state = {k: v.contiguous() for k, v in sdar_model.state_dict().items()}
    assert sorted(state) == sorted(HUB_PARAM_NAMES)
    save_file(state, path / "model.safetensors", metadata={"format": "pt"})
    return path


def test_hub_layout_loads_without_remote_code(hub_checkpoint, sdar_model):
    model = AutoModelForCausalLM.from_pretrained(hub_checkpoint).eval()
    assert type(model) is SDARForCausalLM
    assert model.config.block_size == 4 and model.config.mask_token_id == MASK_ID
    assert model.config._attn_implementation != "flex_attention"
    assert model.generation_config.eos_token_id == [96, 97]
    ids = torch.tensor([[5, 17, 42, 8, 23]])
    torch.testing.assert_close(model(ids).logits, sdar_model(ids).logits, atol=1e-5, rtol=1e-5)
    out = model.generate(ids, decoding_strategy="s2d2", max_new_tokens=8, return_dict_in_generate=True)
    assert out.sequences.shape[1] <= 5 + 8 and out.spec_stats.nfe > 0


def test_stock_generate_still_reachable_on_the_model_class(sdar_model, qwen_model, prompt):
    """Without `decoding_strategy` the SDAR class decodes as a dLLM (test_transformers_behaviour.py); transformers'
    own left-to-right loop stays one explicit call away and is unchanged."""
    from transformers import GenerationMixin

    ours = GenerationMixin.generate(sdar_model, prompt, max_new_tokens=6, do_sample=False, eos_token_id=None)
    stock = qwen_model.generate(prompt, max_new_tokens=6, do_sample=False, eos_token_id=None)
    assert torch.equal(ours, stock)


def test_custom_generate_on_plain_qwen3_matches_sdar_class(sdar_model, qwen_model, prompt):
    kwargs = dict(max_new_tokens=12, eos_token_id=None, do_sample=True, top_k=0, min_ssd_span_length=2)
    via_callable = qwen_model.generate(prompt, custom_generate=hf_dllm_spec.custom_generate, decoding_strategy="s2d2",
                                       mask_token_id=MASK_ID, block_size=4, generator=gen(5), **kwargs)
    via_mixin = sdar_model.generate(prompt, decoding_strategy="s2d2", generator=gen(5), **kwargs)
    assert torch.equal(via_callable, via_mixin)


def test_stats_add_up(sdar_model, prompt):
    for strategy, extra in [("s2d2", {"min_ssd_span_length": 2}), ("block_diffusion", {}), ("ar", {}),
                            ("block_diffusion", {"steps_per_block": 2}),      # two commits per step
                            ("s2d2", {"steps_per_block": 2, "min_ssd_span_length": 4})]:
        out = sdar_model.generate(prompt, decoding_strategy=strategy, max_new_tokens=13, eos_token_id=None,
                                  return_dict_in_generate=True, **extra)
        s = out.spec_stats
        assert s.num_generated_tokens == out.sequences.shape[1] - prompt.shape[1] == 13
        assert s.num_committed_tokens == (s.num_fallback_tokens + s.num_accepted_tokens + s.num_recovered_tokens
                                          + s.num_bonus_tokens)
        assert s.num_committed_tokens == s.num_generated_tokens + s.num_discarded_tokens
        assert s.nfe == s.num_prefill_forwards + s.num_draft_forwards + s.num_verify_forwards + s.num_cache_write_forwards
        assert s.num_draft_forwards == s.num_denoising_steps
        assert sum(s.accepted_length_histogram.values()) == s.num_drafts == s.num_verify_forwards
        assert s.wall_time_s > 0 and s.tpf > 0


@pytest.mark.parametrize("rule", ["low_confidence_static", "sequential", "low_confidence_dynamic"])
def test_the_step_schedule_spans_the_whole_block(sdar_model, rule):
    """SDAR's `get_num_transfer_tokens(block_length, steps)`: a first block that holds a 2-token prompt tail (2
    masks) commits k = 4 / 2 = 2 per step with `steps_per_block=2`, so it takes the one step that
    `steps_per_block=1` takes (before: the schedule spread its 2 masks over 2 steps)."""
    prompt = torch.tensor([[5, 17, 42, 8, 23, 61]])
    runs = [sdar_model.generate(prompt, decoding_strategy="block_diffusion", block_size=4, steps_per_block=steps,
                                remasking_strategy=rule, confidence_threshold=1.0, max_new_tokens=2,
                                eos_token_id=None, return_dict_in_generate=True) for steps in (1, 2)]
    assert runs[0].spec_stats.num_forward_calls == runs[1].spec_stats.num_forward_calls
    assert runs[0].sequences.tolist() == runs[1].sequences.tolist()


def test_stop_id_truncates_and_keeps_eos(sdar_model, prompt):
    free = sdar_model.generate(prompt, decoding_strategy="block_diffusion", max_new_tokens=16, eos_token_id=None)
    new = free[0, prompt.shape[1]:].tolist()
    stop = new[5]
    out = sdar_model.generate(prompt, decoding_strategy="block_diffusion", max_new_tokens=16, eos_token_id=stop)
    assert out[0, prompt.shape[1]:].tolist() == new[: new.index(stop) + 1]


def test_generation_config_round_trip(tmp_path, sdar_model, prompt):
    cfg = S2D2Config.from_preset("sdar-8b-config-a", block_size=8)
    gc = cfg.save_to_generation_config(GenerationConfig(max_new_tokens=8))
    gc.save_pretrained(tmp_path)
    loaded = GenerationConfig.from_pretrained(tmp_path)
    assert S2D2Config.from_dict(loaded.dllm_decoding) == cfg
    with_defaults = sdar_model.generate(prompt, decoding_strategy="s2d2", generation_config=loaded,
                                        eos_token_id=None)
    explicit = sdar_model.generate(prompt, decoding_strategy="s2d2", strategy_config=cfg, max_new_tokens=8,
                                   eos_token_id=None)
    assert torch.equal(with_defaults, explicit)


def test_presets_match_the_paper():
    a = S2D2Config.from_preset("sdar-8b-config-a")
    assert (a.block_size, a.do_verify_policy, a.do_verify_score_type, a.score_penalty_coef, a.cache_ver,
            a.draft_ver, a.token_acceptance_estimator) == (4, "score_threshold", "difference_static", 1.0, True,
                                                           True, "soft_entropy_negexp")
    b = S2D2Config.from_preset("sdar-1.7b-config-b")
    assert (b.block_size, b.min_ssd_span_length, b.cache_ver) == (32, 1, True)


# -- bad input: clear errors, before any forward ------------------------------------------------------------

@pytest.fixture
def no_forward(sdar_model, monkeypatch):
    def boom(*args, **kwargs):
        raise AssertionError("a forward ran before validation finished")
    monkeypatch.setattr(sdar_model, "forward", boom)
    return sdar_model


@pytest.mark.parametrize("kwargs,match", [
    ({"decoding_strategy": "medusa"}, r"`decoding_strategy` \(='medusa'\) must be one of 'ar', 'block_diffusion', 's2d2'"),
    ({"decoding_strategy": "s2d2", "confidence_threshold": 1.5}, r"`confidence_threshold` \(=1.5\) must lie in \(0, 1\]"),
    ({"decoding_strategy": "s2d2", "confidence_threshold": 0.0}, r"`confidence_threshold` \(=0.0\)"),
    ({"decoding_strategy": "s2d2", "ssd_ratio_tempering_factor": -1.0}, r"`ssd_ratio_tempering_factor` \(=-1.0\)"),
    ({"decoding_strategy": "block_diffusion", "block_size": 0}, r"`block_size` \(=0\) must be an integer >= 1"),
    ({"decoding_strategy": "s2d2", "do_verify_policy": "always"}, r"`do_verify_policy` \(='always'\) must be one of"),
    ({"decoding_strategy": "s2d2", "token_acceptance_estimator": "oracle"}, r"`token_acceptance_estimator`"),
    ({"decoding_strategy": "s2d2", "hysteresis_threshold_on": -2.0, "hysteresis_threshold_off": -1.0},
     r"`hysteresis_threshold_on` \(=-2.0\) must be greater than `hysteresis_threshold_off` \(=-1.0\)"),
    ({"decoding_strategy": "block_diffusion", "min_ssd_span_length": 2},
     r"`min_ssd_span_length` \(=2\) must be a parameter of decoding_strategy='block_diffusion'"),
    ({"decoding_strategy": "ar", "block_size": 4}, r"`block_size` \(=4\) must be 1 for decoding_strategy='ar'"),
    ({"decoding_strategy": "s2d2", "max_new_tokens": 0}, r"max_new_tokens"),
    ({"decoding_strategy": "s2d2", "max_new_tokens": 300}, r"`input_ids` .* model's 256 positions"),
    ({"decoding_strategy": "s2d2", "preset": "sdar-99b"}, r"`preset` \(='sdar-99b'\) must be one of"),
])
def test_bad_input_raises_before_forward(no_forward, prompt, kwargs, match):
    with pytest.raises(ValueError, match=match):
        no_forward.generate(prompt, **kwargs)


def test_right_padding_streamer_batch_and_missing_mask_token(no_forward, qwen_model, prompt):
    with pytest.raises(ValueError, match=r"`attention_mask` .* must pad on the left.*padding_side = 'left'"):
        no_forward.generate(prompt, attention_mask=torch.tensor([[1, 1, 1, 1, 1, 1, 0]]), decoding_strategy="s2d2")
    with pytest.raises(ValueError, match=r"`streamer` .* must be used with batch size 1"):
        no_forward.generate(prompt.repeat(2, 1), decoding_strategy="s2d2", pad_token_id=0,
                            streamer=type("S", (), {"put": lambda self, v: None, "end": lambda self: None})())
    with pytest.raises(ValueError, match=r"`pad_token_id` \(=None\) must be set"):
        no_forward.generate(prompt.repeat(2, 1), decoding_strategy="s2d2", eos_token_id=None)
    for sizes in ({"block_size": 4}, {}):          # without a block size too: it asked for one first
        with pytest.raises(ValueError, match=r"`mask_token_id` \(=None\) must be known"):
            qwen_model.generate(prompt, custom_generate=hf_dllm_spec.custom_generate, decoding_strategy="s2d2",
                                **sizes)


def test_context_dependent_processor_is_refused(sdar_model, prompt):
    with pytest.raises(NotImplementedError, match="RepetitionPenaltyLogitsProcessor"):
        sdar_model.generate(prompt, decoding_strategy="s2d2", repetition_penalty=1.3)
    # from the model's own generation config (a Hub generation_config.json sets it, e.g. Qwen2.5's 1.05): the fix
    # says how to unset it (it said "drop `repetition_penalty`", an option the call never passed), and it works
    model = copy.deepcopy(sdar_model)
    model.generation_config.repetition_penalty = 1.05
    with pytest.raises(NotImplementedError, match=r"pass repetition_penalty=None to generate, or set "
                                                  r"`generation_config.repetition_penalty = None`"):
        model.generate(prompt, decoding_strategy="s2d2", max_new_tokens=4)
    assert torch.equal(model.generate(prompt, decoding_strategy="s2d2", max_new_tokens=4, repetition_penalty=None),
                       sdar_model.generate(prompt, decoding_strategy="s2d2", max_new_tokens=4))


def test_untrained_block_size_warns(sdar_model, prompt):
    with pytest.warns(UserWarning, match=r"`block_size` \(=8\) differs from the checkpoint's trained block size") as seen:
        sdar_model.generate(prompt, decoding_strategy="block_diffusion", block_size=8, max_new_tokens=4)
    assert seen[0].filename == __file__          # the warning points at the caller, not at the library


def test_hub_custom_generate_directory(qwen_model, sdar_model, prompt):
    """`custom_generate="<dir>"` (the repo's custom_generate/generate.py) runs the same strategy code."""
    import pathlib

    repo = pathlib.Path(__file__).resolve().parents[1]
    kwargs = dict(max_new_tokens=8, eos_token_id=None, block_size=4)
    via_dir = qwen_model.generate(prompt, custom_generate=str(repo), trust_remote_code=True,
                                  decoding_strategy="s2d2", mask_token_id=MASK_ID, **kwargs)
    assert torch.equal(via_dir, sdar_model.generate(prompt, decoding_strategy="s2d2", **kwargs))


def test_streamer_receives_prompt_tokens_and_end(sdar_model, prompt):
    class Recorder:
        def __init__(self):
            self.chunks, self.ended = [], False

        def put(self, value):
            self.chunks.append(value.reshape(-1).tolist())

        def end(self):
            self.ended = True

    rec = Recorder()
    out = sdar_model.generate(prompt, decoding_strategy="s2d2", max_new_tokens=8, eos_token_id=None, streamer=rec)
    assert rec.ended and rec.chunks[0] == prompt[0].tolist()
    assert sum(rec.chunks[1:], []) == out[0, prompt.shape[1]:].tolist()


def test_stats_merge_sums_counters_lists_and_histograms(sdar_model, prompt):
    from hf_dllm_spec import SpecDecodingStats

    runs = [sdar_model.generate(prompt, decoding_strategy="s2d2", max_new_tokens=n, eos_token_id=None,
                                return_dict_in_generate=True, min_ssd_span_length=2).spec_stats for n in (8, 13)]
    merged = SpecDecodingStats().merge(runs[0]).merge(runs[1])
    assert merged.nfe == runs[0].nfe + runs[1].nfe
    assert merged.num_draft_tokens == runs[0].num_draft_tokens + runs[1].num_draft_tokens
    width = max(len(r.num_accepted_tokens_per_pos) for r in runs)
    assert merged.num_accepted_tokens_per_pos == [
        sum(r.num_accepted_tokens_per_pos[i] if i < len(r.num_accepted_tokens_per_pos) else 0 for r in runs)
        for i in range(width)]
    assert merged.accepted_length_histogram == runs[0].accepted_length_histogram + runs[1].accepted_length_histogram
    assert merged.wall_time_s == pytest.approx(runs[0].wall_time_s + runs[1].wall_time_s)


def test_a_sliding_window_model_decodes_below_its_window_and_refuses_beyond():
    """A target with sliding-window layers (Mistral; Qwen2 with `use_sliding_window`): below the window the loop's
    full masks are the model's own (stock greedy tokens); a call that would reach it is refused before any forward
    (before: wrong logits past the window, then a shape error once the sliding cache dropped keys)."""
    from transformers import MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    common = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, sliding_window=12, max_position_embeddings=128)
    ids = torch.randint(1, 60, (1, 6), generator=torch.Generator().manual_seed(1))
    for model in (MistralForCausalLM(MistralConfig(**common)).eval(),
                  Qwen2ForCausalLM(Qwen2Config(**common, use_sliding_window=True, max_window_layers=0)).eval()):
        out = model.generate(ids, custom_generate=hf_dllm_spec.custom_generate, decoding_strategy="ar",
                             max_new_tokens=4)            # positions 0-9, plus 2 of read-only room: inside 12
        assert out.tolist() == model.generate(ids, max_new_tokens=4, do_sample=False).tolist()
        with pytest.raises(ValueError, match=r"sliding attention window of `model` \(12 positions\)"):
            model.generate(ids, custom_generate=hf_dllm_spec.custom_generate, decoding_strategy="ar",
                           max_new_tokens=5)


def test_s2d2_on_a_sliding_window_model_keeps_its_read_only_queries_inside_the_window(sdar_model, prompt):
    """S2D2's verifier appends a block of read-only queries to the cache before rolling it back: the window must hold
    them too (before: a call below the window by the plan's count failed in the sliding cache's `crop`)."""
    import copy

    from model_patches.sdar import SDARForCausalLM

    config = copy.deepcopy(sdar_model.config)
    config.layer_types, config.sliding_window = ["sliding_attention"] * config.num_hidden_layers, 24
    sliding = SDARForCausalLM(config).eval()
    sliding.load_state_dict(sdar_model.state_dict())
    call = dict(decoding_strategy="s2d2", eos_token_id=None)
    assert torch.equal(sliding.generate(prompt, max_new_tokens=5, **call),
                       sdar_model.generate(prompt, max_new_tokens=5, **call))   # blocks to 12, 8 of queries: 20
    with pytest.raises(ValueError, match=r"plus 8 read-only query positions, in the sliding attention window"):
        sliding.generate(prompt, max_new_tokens=10, **call)


@pytest.mark.parametrize("family,keyword", [("sdar", "store_kv"), ("llada2", "store_kv"),
                                            ("fast", "update_past_key_values")])
def test_the_hub_read_only_cache_keyword_is_honoured(family, keyword):
    """The Hub modelings write a cache only when told (SDAR's and S2D2's LLaDA2 port's `store_kv=True`, Fast-dLLM
    v2's `update_past_key_values=True`; their scripts denoise with False); before, the keyword vanished into
    `**kwargs` and every denoising forward of such a script grew the cache (SDAR was fixed first)."""
    from transformers import DynamicCache

    from model_patches.compat import CACHE_KWARG

    model = tiny_family_models()[family]
    cache = DynamicCache(config=model.config)
    ids = torch.tensor([[5, 17, 42, 8]])
    with torch.no_grad():
        model(ids, **{CACHE_KWARG: cache, keyword: True}, use_cache=True)
        read = [model(ids, **{CACHE_KWARG: cache, keyword: False}, use_cache=True).logits for _ in range(2)]
        assert cache.get_seq_length() == 4 and torch.equal(read[0], read[1])
        model(ids, **{CACHE_KWARG: cache}, use_cache=True)                        # transformers' default: writes
        assert cache.get_seq_length() == 8
        model(ids, None, None, cache, use_cache=True, **{keyword: False})        # the cache passed by position
        assert cache.get_seq_length() == 8
        with pytest.raises(ValueError, match=rf"`{keyword}` \(=0\) must be True, False or unset"):
            model(ids, **{keyword: 0})


@pytest.mark.parametrize("params", [dict(steps_per_block=2),
                                    dict(steps_per_block=3, remasking_strategy="low_confidence_static")])
def test_a_verified_s2d2_step_is_topped_up_to_the_schedule(sdar_model, prompt, params, monkeypatch):
    """With fewer denoising steps than block positions the schedule asks k > 1 commits of a step; the reference then
    tops a verified step up to min(k, masks) by the fallback rule (before: it committed the accepted span only, and
    a block took more than `steps_per_block` steps)."""
    from hf_dllm_spec.strategies.s2d2 import S2D2Strategy

    steps, original = [], S2D2Strategy.denoise_step

    def spy(self, block, logits):
        least, before = self.least_commits(block), block.masked.sum(dim=1)
        original(self, block, logits)
        steps.append((least, before - block.masked.sum(dim=1)))

    monkeypatch.setattr(S2D2Strategy, "denoise_step", spy)
    out = sdar_model.generate(prompt, decoding_strategy="s2d2", block_size=4, max_new_tokens=12, eos_token_id=None,
                              return_dict_in_generate=True, **params)
    assert out.spec_stats.num_verify_forwards > 0 and any(int(least.max()) > 1 for least, _ in steps)
    assert all(bool((committed >= least).all()) for least, committed in steps)


def test_ar_on_a_right_shifted_model_takes_its_own_mask_id_and_never_suppresses_it():
    """`ar` on a right-shifted model decodes without a mask token: the model's own id is accepted (a loop that
    passes `mask_token_id=tokenizer.mask_token_id` to every strategy), another one is refused, and the tokens are
    transformers' greedy ones (the mask id is not suppressed from the distribution)."""
    from transformers import GenerationMixin

    from model_patches.fast_dllm_v2 import Fast_dLLM_QwenConfig, Fast_dLLM_QwenForCausalLM

    torch.manual_seed(0)
    model = Fast_dLLM_QwenForCausalLM(Fast_dLLM_QwenConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, bd_size=4, mask_token_id=63)).eval()
    ids = torch.tensor([[5, 17, 42, 8, 23]])
    greedy = GenerationMixin.generate(model, ids, max_new_tokens=6, do_sample=False, eos_token_id=None)
    out = model.generate(ids, decoding_strategy="ar", max_new_tokens=6, eos_token_id=None, mask_token_id=63)
    assert out.tolist() == greedy.tolist()
    with pytest.raises(ValueError, match=r"`mask_token_id` \(=62\) must be unset \(or the model's own\)"):
        model.generate(ids, decoding_strategy="ar", max_new_tokens=6, eos_token_id=None, mask_token_id=62)



def test_statistics_arithmetic_on_hand_computed_values():
    """`SpecDecodingStats` / `BatchStats` (docs/metrics.md): discarded tokens, NFE and tokens per forward, the
    per-position acceptance, tau, NaN acceptance without drafts; in a batch, a row without a draft this cycle adds no
    histogram entry and no per-position zeros, and the call's totals keep the batch's forward calls and times (they
    were summed over rows)."""
    import math

    from hf_dllm_spec.outputs import BatchStats, SpecDecodingStats

    s = SpecDecodingStats(num_committed_tokens=8)
    s.record_output(6)
    assert (s.num_generated_tokens, s.num_discarded_tokens) == (6, 2)
    s = SpecDecodingStats(num_prefill_forwards=1, num_draft_forwards=3, num_cache_write_forwards=1,
                          num_generated_tokens=8)
    assert s.nfe == 5 and s.tpf == 8 / (5 - 1)                   # tokens per forward after the prefill
    s = SpecDecodingStats()
    s.observe_verification(3, 1, recovered=True, bonus=False)
    s.observe_verification(2, 2, False, True)
    assert s.num_accepted_tokens_per_pos == [2, 1, 0] and s.num_drafts_reaching_pos == [2, 2, 1]
    assert s.mean_acceptance_length == (3 + 1 + 1) / 2           # accepted plus the recovered or bonus token
    assert math.isnan(SpecDecodingStats().acceptance_rate)

    batch = BatchStats(2)                              # row 0 drafts 3 and accepts 1; row 1 drafts nothing
    batch.observe_verification(torch.tensor([0, 1]), torch.tensor([3, 0]), torch.tensor([1, 0]),
                               torch.tensor([True, False]), torch.tensor([False, False]), width=3)
    batch.flush()
    first, second = batch.per_row
    assert dict(first.accepted_length_histogram) == {1: 1} and dict(second.accepted_length_histogram) == {}
    assert first.num_accepted_tokens_per_pos == [1, 0, 0] and first.num_drafts_reaching_pos == [1, 1, 1]
    assert second.num_accepted_tokens_per_pos == [] == second.num_drafts_reaching_pos

    batch = BatchStats(2)                              # two batched calls, the second for row 0 alone
    batch.count_forward("prefill")
    batch.count_forward("draft", rows=[True, False])
    for row in batch.per_row:
        row.wall_time_s, row.prefill_time_s = 1.5, 0.5
    total = batch.total()
    assert [row.nfe for row in batch.per_row] == [2, 1] and total.num_forward_calls == 2
    assert (total.wall_time_s, total.prefill_time_s) == (1.5, 0.5)


def test_the_bandit_is_rewarded_with_the_tokens_each_step_committed(sdar_model, prompt, monkeypatch):
    """The UCB policy's feedback (`observe`) is the step's committed tokens: a verified step's accepted drafts plus
    the recovered or bonus token (it was fed the accepted drafts alone), an unverified step's rule commits."""
    from hf_dllm_spec.maths.routing import UCBPolicy

    seen = []
    observe = UCBPolicy.observe
    monkeypatch.setattr(UCBPolicy, "observe",
                        lambda self, num, verified: seen.append((num, verified)) or observe(self, num, verified))
    out = sdar_model.generate(prompt, decoding_strategy="s2d2", do_verify_policy="contextual_bandit_ucb",
                              block_size=4, max_new_tokens=24, eos_token_id=None, return_dict_in_generate=True)
    s = out.spec_stats
    assert any(verified for _, verified in seen) and not all(verified for _, verified in seen)
    assert sum(num for num, verified in seen if verified) == (s.num_accepted_tokens + s.num_recovered_tokens
                                                            + s.num_bonus_tokens)
    assert sum(num for num, _ in seen) == s.num_committed_tokens
