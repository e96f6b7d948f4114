"""Placement (docs/placement.md): each model keeps its own device, dtype and accelerate dispatch.

On CPU: bundled models loaded with a `device_map` that offloads decoder layers to "disk" (`offload_folder`) give
the plain model's greedy tokens, token for token; an offloaded first parameter (embeddings on disk: `model.device`
is "meta") runs on the hook's execution device; SimSD / DEER run with an offloaded target and a plain (fp32 or
bf16) drafter, each cache staying with its own model. Two devices cannot be exercised without a GPU: the moves
between them are `.to()` no-ops here. Tensor parallelism: `tests/test_llada2_tp.py` (SDAR and LLaDA2).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from transformers import AutoModelForCausalLM

import hf_dllm_spec
import hf_dllm_spec.runtime.static as static_runtime
from hf_dllm_spec.tools.jobs.evaluation import ROOT, arithmetic_prompts, load
from hf_dllm_spec.runtime.weights import execution_device
from hf_dllm_spec.runtime.runner import ModelRunner
from recipes.arithmetic import format_prompt

SDAR_DIR = ROOT / "models" / "sdar-tiny-arith"
FAST_DIR = ROOT / "models" / "fast-dllm-v2-tiny"
AR_DIR = ROOT / "models" / "qwen2-tiny-ar"
DEER_DRAFTER_DIR = ROOT / "models" / "deer-drafter-tiny"
NEW = 16


def _device_map(embeddings: str = "cpu") -> dict[str, str]:
    """The bundled 4-layer Qwen-layout models: layers 0 and 2 (and the norm) on disk, 1 and 3 on cpu. Without a GPU
    accelerate's main device is the CPU, so "disk" entries are the offloaded ones (weights loaded per forward)."""
    return {"model.embed_tokens": embeddings, "model.rotary_emb": "cpu", "model.layers.0": "disk",
            "model.layers.1": "cpu", "model.layers.2": "disk", "model.layers.3": "cpu", "model.norm": "disk",
            "lm_head": embeddings}


def _offloaded(path, tmp_path_factory, embeddings: str = "cpu", dtype=torch.float32):
    folder = tmp_path_factory.mktemp("offload")
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, device_map=_device_map(embeddings),
                                                offload_folder=str(folder)).eval()


def _prompts(tokenizer, path, n: int = 2) -> list[torch.Tensor]:
    return [tokenizer(p.text, return_tensors="pt").input_ids for p in arithmetic_prompts(path, n)]


@pytest.fixture(scope="module")
def sdar(tmp_path_factory):
    tokenizer, plain = load(SDAR_DIR)
    return tokenizer, plain, _offloaded(SDAR_DIR, tmp_path_factory), _prompts(tokenizer, SDAR_DIR)


@pytest.fixture(scope="module")
def sdar_meta(tmp_path_factory):
    """sdar-tiny-arith with its (tied) embeddings on disk: `model.device` is "meta"."""
    return _offloaded(SDAR_DIR, tmp_path_factory, embeddings="disk")


@pytest.fixture(scope="module")
def sdar_bf16():
    return load(SDAR_DIR, torch.bfloat16)[1]


@pytest.fixture(scope="module")
def deer_models(tmp_path_factory):
    """The AR target plain and with its embeddings on disk (meta `model.device`), the DEER drafter fp32 and bf16."""
    tokenizer, ar = load(AR_DIR)
    return (ar, _offloaded(AR_DIR, tmp_path_factory, embeddings="disk"), load(DEER_DRAFTER_DIR)[1],
            load(DEER_DRAFTER_DIR, torch.bfloat16)[1], _prompts(tokenizer, AR_DIR))


@pytest.fixture
def runners(monkeypatch):
    """Every `ModelRunner` `generate` builds in this test (target first, then the drafter)."""
    built: list[ModelRunner] = []

    class Recording(ModelRunner):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            built.append(self)

    monkeypatch.setattr(static_runtime, "ModelRunner", Recording)   # the eager runtime `generate` builds
    return built


def _assert_cache_stays(runner: ModelRunner, dtype: torch.dtype) -> None:
    """The runner's stored context lives on its execution device, the K/V in its model's dtype (read after the
    call: finished rows have left the batch, the stored columns and their device / dtype remain)."""
    assert runner.device == execution_device(runner.model) and runner.dtype == dtype
    assert runner.valid.device == runner.device
    layers = [layer for layer in runner.cache.layers if getattr(layer, "keys", None) is not None]
    assert len(layers) == runner.model.config.num_hidden_layers
    for layer in layers:
        assert layer.keys.shape[-2] > 0 and layer.keys.device == runner.device == layer.values.device
        assert layer.keys.dtype == layer.values.dtype == dtype


# -- the execution device --------------------------------------------------------------------------------------------
def test_execution_device_is_the_hook_device_when_the_first_parameter_is_offloaded(sdar, sdar_meta):
    _, plain, offloaded, _ = sdar
    assert execution_device(plain) == plain.device == torch.device("cpu")
    assert "disk" in offloaded.hf_device_map.values() and execution_device(offloaded) == torch.device("cpu")
    assert sdar_meta.device.type == "meta"                     # what `model.device` says under offload
    assert execution_device(sdar_meta) == torch.device("cpu")  # where accelerate runs the forward
    assert sdar_meta.dtype == torch.float32                    # meta parameters keep their dtype


# -- (a) one offloaded model --------------------------------------------------------------------------------------
@pytest.mark.parametrize("strategy", ["ar", "block_diffusion", "s2d2"])
def test_disk_offloaded_sdar_equals_the_plain_model(sdar, strategy):
    _, plain, offloaded, prompts = sdar
    for ids in prompts:
        expected = plain.generate(ids, decoding_strategy=strategy, max_new_tokens=NEW)
        assert offloaded.generate(ids, decoding_strategy=strategy, max_new_tokens=NEW).tolist() == expected.tolist()


def test_disk_offloaded_sdar_batch_equals_the_plain_batch(sdar):
    tokenizer, plain, offloaded, prompts = sdar
    tokenizer.padding_side = "left"
    enc = tokenizer([tokenizer.decode(p[0]) for p in prompts], return_tensors="pt", padding=True)
    kwargs = dict(attention_mask=enc.attention_mask, decoding_strategy="s2d2", max_new_tokens=NEW)
    assert offloaded.generate(enc.input_ids, **kwargs).tolist() == plain.generate(enc.input_ids, **kwargs).tolist()


def test_disk_offloaded_fast_dllm_v2_equals_the_plain_model(tmp_path_factory):
    tokenizer, plain = load(FAST_DIR)
    offloaded = _offloaded(FAST_DIR, tmp_path_factory)
    for ids in _prompts(tokenizer, FAST_DIR):
        expected = plain.generate(ids, decoding_strategy="fast_dllm_v2", max_new_tokens=NEW)
        assert offloaded.generate(ids, decoding_strategy="fast_dllm_v2", max_new_tokens=NEW).tolist() == \
            expected.tolist()


def test_meta_device_ar_target_runs_on_its_execution_device(deer_models, runners):
    ar, ar_meta, _, _, prompts = deer_models
    assert ar_meta.device.type == "meta"
    for ids in prompts:
        out = ar_meta.generate(ids, custom_generate=hf_dllm_spec.custom_generate, decoding_strategy="ar",
                               max_new_tokens=NEW)
        assert out.tolist() == ar.generate(ids, max_new_tokens=NEW, do_sample=False).tolist()
    _assert_cache_stays(runners[-1], torch.float32)


def test_meta_device_sdar_through_its_own_generate(sdar, sdar_meta):
    _, plain, _, prompts = sdar
    out = sdar_meta.generate(prompts[0], decoding_strategy="s2d2", max_new_tokens=NEW)
    assert out.tolist() == plain.generate(prompts[0], decoding_strategy="s2d2", max_new_tokens=NEW).tolist()


# -- (b), (c) an offloaded target, a drafter of its own ----------------------------------------------------------------
def test_simsd_offloaded_target_plain_or_offloaded_drafter_equals_plain(sdar, sdar_meta, runners):
    _, plain, offloaded, prompts = sdar
    for ids in prompts:
        expected = plain.generate(ids, decoding_strategy="simsd", draft_model=plain, max_new_tokens=NEW).tolist()
        assert offloaded.generate(ids, decoding_strategy="simsd", draft_model=plain,
                                  max_new_tokens=NEW).tolist() == expected
        # a drafter whose first parameter is offloaded (`model.device` "meta"): never checked by `check_call`
        assert offloaded.generate(ids, decoding_strategy="simsd", draft_model=sdar_meta,
                                  max_new_tokens=NEW).tolist() == expected
        target, drafter = runners[-2:]
        assert target.model is offloaded and drafter.model is sdar_meta and drafter.device == torch.device("cpu")
        _assert_cache_stays(target, torch.float32)
        _assert_cache_stays(drafter, torch.float32)


def test_simsd_bf16_drafter_with_fp32_offloaded_target(sdar, sdar_bf16, runners):
    """The exact preset reproduces the target's sequential block diffusion for any drafter, bf16 included."""
    _, _, offloaded, prompts = sdar
    for ids in prompts:
        out = offloaded.generate(ids, decoding_strategy="simsd", draft_model=sdar_bf16, preset="simsd-exact",
                                 max_new_tokens=NEW)
        target, drafter = runners[-2:]
        assert target.model is offloaded and drafter.model is sdar_bf16
        _assert_cache_stays(target, torch.float32)
        _assert_cache_stays(drafter, torch.bfloat16)      # the drafter's K/V stay bf16, its masks too
        assert out.tolist() == offloaded.generate(ids, decoding_strategy="block_diffusion",
                                                  remasking_strategy="sequential", steps_per_block=4,
                                                  max_new_tokens=NEW).tolist()


@pytest.mark.parametrize("draft_dtype", [torch.float32, torch.bfloat16])
def test_deer_meta_target_equals_plain_and_greedy_ar(deer_models, runners, draft_dtype):
    """Greedy DEER is lossless: the offloaded target's greedy tokens, whatever the drafter's dtype."""
    ar, ar_meta, drafter32, drafter16, prompts = deer_models
    drafter = drafter32 if draft_dtype == torch.float32 else drafter16
    kwargs = dict(custom_generate=hf_dllm_spec.custom_generate, decoding_strategy="deer", block_size=4,
                  max_new_tokens=NEW)
    for ids in prompts:
        out = ar_meta.generate(ids, draft_model=drafter, **kwargs).tolist()
        target, drafter_runner = runners[-2:]
        assert target.model is ar_meta and drafter_runner.model is drafter
        _assert_cache_stays(target, torch.float32)
        _assert_cache_stays(drafter_runner, draft_dtype)
        assert out == ar.generate(ids, max_new_tokens=NEW, do_sample=False).tolist()
        if draft_dtype == torch.float32:
            assert out == ar.generate(ids, draft_model=drafter32, **kwargs).tolist()


# -- what transformers' assisted decoding cannot take: refused before any forward, with the call that works ----------
def test_assisted_decoding_refuses_models_whose_device_is_meta(deer_models, sdar_meta, tmp_path_factory):
    """transformers' assisted decoding moves the ids to `model.device` / `assistant_model.device` ("meta" when the
    first parameter is offloaded): the drafter as a stock target's `assistant_model`, and the target of
    `deer_assisted_generate`, are refused with the call that runs them (they failed inside torch or accelerate);
    the same pair through `custom_generate` decodes."""
    from hf_dllm_spec.integration.candidate_generator import deer_assisted_generate

    ar, ar_meta, drafter, _, prompts = deer_models
    drafter_meta = _offloaded(DEER_DRAFTER_DIR, tmp_path_factory, embeddings="disk")
    with pytest.raises(ValueError, match=r"`assistant_model` .*first parameter is offloaded.*custom_generate"):
        ar.generate(prompts[0], assistant_model=drafter_meta, max_new_tokens=8, do_sample=False)
    with pytest.raises(ValueError, match=r"`model` .*first parameter is offloaded.*decoding_strategy='deer'"):
        deer_assisted_generate(ar_meta, prompts[0], drafter, max_new_tokens=8, num_draft_tokens=4)
    out = ar.generate(prompts[0], custom_generate=hf_dllm_spec.custom_generate, decoding_strategy="deer",
                      draft_model=drafter_meta, block_size=4, max_new_tokens=8)
    assert out.tolist() == ar.generate(prompts[0], max_new_tokens=8, do_sample=False).tolist()


def test_a_never_loaded_assistant_is_named_as_passed(deer_models):
    """A drafter on the meta device given as `assistant_model` is refused under that name (it said `draft_model`)."""
    from transformers import AutoConfig

    ar, _, _, _, prompts = deer_models
    with torch.device("meta"):
        never_loaded = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(DEER_DRAFTER_DIR))
    with pytest.raises(ValueError, match=r"^`assistant_model` \(='<SDARForCausalLM on the meta device>'\)"):
        ar.generate(prompts[0], assistant_model=never_loaded, max_new_tokens=8, do_sample=False)


def test_a_model_with_a_part_on_meta_and_no_hook_is_refused(sdar):
    """A layer moved to "meta" by hand (no accelerate hook brings it in per forward) is refused, naming the first
    such weight, as target and as SimSD drafter (it failed inside torch at the first forward); offloaded layers,
    on "meta" under their hooks, pass."""
    import copy

    tokenizer, plain, offloaded, prompts = sdar
    part = copy.deepcopy(plain)
    part.model.layers[2].to("meta")
    with pytest.raises(ValueError, match=r"`model` .*`model\.layers\.2\..*` is on the meta device"):
        part.generate(prompts[0], decoding_strategy="s2d2", max_new_tokens=8)
    with pytest.raises(ValueError, match=r"`draft_model` .*`model\.layers\.2\..*` is on the meta device"):
        plain.generate(prompts[0], decoding_strategy="simsd", draft_model=part, max_new_tokens=8)
    assert any(p.device.type == "meta" for p in offloaded.parameters())
    assert offloaded.generate(prompts[0], decoding_strategy="s2d2", max_new_tokens=8).tolist() == \
        plain.generate(prompts[0], decoding_strategy="s2d2", max_new_tokens=8).tolist()


# -- the example -------------------------------------------------------------------------------------------------
def _example():
    spec = importlib.util.spec_from_file_location("multi_gpu_example", ROOT / "examples" / "multi_gpu.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_multi_gpu_example_runs_offloaded_on_cpu(sdar, capsys):
    tokenizer, plain, _, _ = sdar
    example = _example()
    out = example.main(["--max-new-tokens", "8"])
    printed = capsys.readouterr().out
    assert "'disk'" in printed and "runs on cpu" in printed     # device_map="auto" put layers on disk
    ids = tokenizer(format_prompt(example.DEFAULT_QUESTION), return_tensors="pt").input_ids
    assert out.tolist() == plain.generate(ids, decoding_strategy="s2d2", max_new_tokens=8, do_sample=False).tolist()
    with pytest.raises(ValueError, match="--max-memory"):
        example.parse_max_memory("cpu")
