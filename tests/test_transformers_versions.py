"""What differs between the supported transformers versions, and what must not: the cache's name
(`model_patches.compat`), stock `generate()` keeping its KV cache on every family, and tokens."""

from __future__ import annotations

import pytest
import torch
from conftest import LLADA2_TINY, MASK_ID, TINY
from transformers import DynamicCache, GenerationMixin, Qwen2Config, Qwen2ForCausalLM

from model_patches import compat
from model_patches.fast_dllm_v2 import Fast_dLLM_QwenConfig, Fast_dLLM_QwenForCausalLM
from model_patches.llada2 import LLaDA2MoeConfig, LLaDA2MoeModelLM
from model_patches.sdar import SDARConfig, SDARForCausalLM

PROMPT = torch.tensor([[5, 17, 42, 8, 23, 61, 4]])


def _family_models() -> dict:
    """One tiny random model per family with its own forward or transformers' (position-aligned and right-shifted,
    dense and MoE)."""
    torch.manual_seed(0)
    return {
        "sdar": SDARForCausalLM(SDARConfig(block_size=4, mask_token_id=MASK_ID, **TINY)),
        "fast_dllm_v2": Fast_dLLM_QwenForCausalLM(Fast_dLLM_QwenConfig(bd_size=4, mask_token_id=MASK_ID, **TINY)),
        "llada2": LLaDA2MoeModelLM(LLaDA2MoeConfig(block_size=4, mask_token_id=MASK_ID, **LLADA2_TINY)),
        "qwen2": Qwen2ForCausalLM(Qwen2Config(**TINY)),
    }


FAMILIES = _family_models()
CAUSAL = ("sdar", "fast_dllm_v2", "qwen2")        # causal attention: a KV cache changes no token


class ForwardSpy:
    """Records, per forward of a model, the query width, the cache it received (under either name) and the
    cache's length then (-1 without a cache)."""

    def __init__(self, model) -> None:
        self.calls: list[tuple[int, object]] = []
        self.lengths: list[int] = []
        self.handle = model.register_forward_pre_hook(self.hook, with_kwargs=True)

    def hook(self, module, args, kwargs) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        cache = compat.find_cache(kwargs)
        self.calls.append((int(ids.shape[1]), cache))
        self.lengths.append(cache.get_seq_length() if cache is not None else -1)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.handle.remove()


def _manual_greedy(model, ids: torch.Tensor, steps: int, *, use_cache: bool) -> torch.Tensor:
    """Greedy decoding written out: with a cache, the prompt then one token per forward; without, the whole
    sequence every time. The keyword is this transformers' own (`compat.cache_kwarg`)."""
    cache = DynamicCache(config=model.config) if use_cache else None
    seq, query = ids, ids
    for _ in range(steps):
        position_ids = torch.arange(seq.shape[1] - query.shape[1], seq.shape[1])[None]
        logits = model(input_ids=query, position_ids=position_ids, use_cache=use_cache, **compat.cache_kwarg(cache)).logits
        nxt = logits[:, -1].argmax(-1, keepdim=True)
        seq = torch.cat([seq, nxt], dim=1)
        query = nxt if use_cache else seq
    return seq


def test_cache_keyword_is_the_one_generate_prepares():
    """`compat.CACHE_KWARG` is where this transformers' `generate()` puts the cache for a `custom_generate` callable."""
    seen = {}

    def record(model, input_ids, logits_processor=None, stopping_criteria=None, generation_config=None,
               synced_gpus=False, **model_kwargs):
        seen.update(model_kwargs)
        return input_ids

    GenerationMixin.generate(FAMILIES["qwen2"], PROMPT, custom_generate=record, max_new_tokens=2)
    caches = {name: value for name, value in seen.items() if isinstance(value, DynamicCache)}
    assert list(caches) == [compat.CACHE_KWARG]
    assert compat.CACHE_KWARG in compat.CACHE_NAMES


def test_output_field_and_forward_keyword_round_trip():
    model = FAMILIES["qwen2"]
    cache = DynamicCache(config=model.config)
    out = model(input_ids=PROMPT, use_cache=True, **compat.cache_kwarg(cache))
    assert compat.output_cache(out) is cache and cache.get_seq_length() == PROMPT.shape[1]


def test_find_cache_reads_either_name_and_refuses_two_caches():
    a, b = DynamicCache(), DynamicCache()
    assert compat.find_cache({"cache": a}) is a and compat.find_cache({"past_key_values": a}) is a
    assert compat.find_cache({"cache": None, "past_key_values": a}) is a
    assert compat.find_cache({"cache": a, "past_key_values": a}) is a
    assert compat.find_cache({"attention_mask": None}) is None
    with pytest.raises(ValueError, match=r"`cache` and `past_key_values`.*pass only"):
        compat.find_cache({"cache": a, "past_key_values": b})
    kwargs = {"cache": a, "past_key_values": None, "use_cache": True}
    assert compat.pop_cache(kwargs) is a and kwargs == {"use_cache": True}


@pytest.mark.parametrize("name", compat.CACHE_NAMES)
def test_library_forward_takes_the_cache_under_both_names(name):
    """LLaDA2's own forward (the pattern every version reaches: `past_key_values` up to 5.23, `cache` from 5.24)."""
    model = FAMILIES["llada2"]
    cache = DynamicCache(config=model.config)
    out = model(input_ids=PROMPT, use_cache=True, **{name: cache})
    assert compat.output_cache(out) is cache and cache.get_seq_length() == PROMPT.shape[1]
    step = model(input_ids=PROMPT[:, :1], position_ids=torch.tensor([[PROMPT.shape[1]]]), **{name: cache}).logits
    assert cache.get_seq_length() == PROMPT.shape[1] + 1 and torch.isfinite(step).all()


def test_the_crop_of_a_cache_that_cannot_crop_is_a_clear_error():
    cache = DynamicCache()
    cache.update(torch.zeros(1, 2, 5, 8), torch.zeros(1, 2, 5, 8), 0)
    compat.crop(cache, 2)
    assert cache.get_seq_length() == 3

    class Rigid:
        is_croppable = False

    class RigidCache:
        layers = [Rigid()]

    with pytest.raises(NotImplementedError, match="cannot drop its last 2 tokens.*DynamicCache"):
        compat.crop(RigidCache(), 2)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_stock_generate_keeps_its_kv_cache(family):
    """Stock `generate()` (no strategy: the AR baseline) hands every forward the cache and one new token per step on
    every family, and its tokens are those of greedy decoding written out with the cache; on a causal family they
    also equal stock decoding without a cache. A forward that lost the cache (transformers 5.24 renamed it) would
    show full-width forwards and no cache."""
    model = FAMILIES[family].eval()
    steps = 6
    with ForwardSpy(model) as spy:
        cached = GenerationMixin.generate(model, PROMPT, max_new_tokens=steps, do_sample=False, eos_token_id=None,
                                          pad_token_id=0, use_cache=True)
    widths = [w for w, _ in spy.calls]
    assert widths == [PROMPT.shape[1]] + [1] * (steps - 1)
    assert all(isinstance(c, DynamicCache) for _, c in spy.calls) and len({id(c) for _, c in spy.calls}) == 1
    assert torch.equal(cached, _manual_greedy(model, PROMPT, steps, use_cache=True))
    uncached = GenerationMixin.generate(model, PROMPT, max_new_tokens=steps, do_sample=False, eos_token_id=None,
                                        pad_token_id=0, use_cache=False)
    assert torch.equal(uncached, _manual_greedy(model, PROMPT, steps, use_cache=False))
    if family in CAUSAL:
        assert torch.equal(cached, uncached)


@pytest.mark.parametrize("family", ["sdar", "fast_dllm_v2", "llada2"])
def test_strategies_keep_their_cache_under_this_transformers(family):
    """A strategy's decoding with the cache transformers prepared (under this version's name) equals decoding
    without one."""
    model = FAMILIES[family].eval()
    strategy = {"sdar": {"decoding_strategy": "s2d2"}, "llada2": {"decoding_strategy": "llada2"},
                "fast_dllm_v2": {"decoding_strategy": "fast_dllm_v2", "sub_block_size": 2}}[family]
    kwargs = dict(max_new_tokens=12, eos_token_id=None, pad_token_id=0, **strategy)
    with ForwardSpy(model) as spy:
        cached = model.generate(PROMPT, **kwargs)
    assert spy.lengths[0] == 0 and max(spy.lengths) > PROMPT.shape[1]       # forwards read a growing cache
    assert torch.equal(cached, model.generate(PROMPT, use_cache=False, **kwargs))


def test_a_user_cache_under_the_old_name_reaches_the_decoding_check():
    """`past_key_values=` (the name of transformers <= 5.23, deprecated from 5.24) still names the cache, and a
    static one is refused with the library's message, whichever version is installed."""
    from transformers import StaticCache

    model = FAMILIES["sdar"]
    cache = StaticCache(config=model.config, max_cache_len=64)
    with pytest.raises(ValueError, match=rf"`{compat.CACHE_KWARG}` \(='StaticCache'\) must be an empty DynamicCache"):
        model.generate(PROMPT, decoding_strategy="s2d2", max_new_tokens=4, past_key_values=cache)


def test_pipeline_decodes_with_a_strategy_as_generate_does():
    """transformers' text-generation `pipeline` (its own batching, left padding, generate kwargs) on the bundled SDAR
    model: each text equals `model.generate` of that prompt alone (greedy: the pipeline's own default samples)."""
    from transformers import pipeline

    from hf_dllm_spec.tools.jobs.evaluation import ROOT, arithmetic_prompts, load

    path = ROOT / "models" / "sdar-tiny-arith"
    tokenizer, model = load(path)
    tokenizer.padding_side = "left"
    texts = [p.text for p in arithmetic_prompts(path, 3)]
    pipe = pipeline("text-generation", model=model, tokenizer=tokenizer)
    kwargs = dict(decoding_strategy="s2d2", block_size=4, max_new_tokens=16, do_sample=False)
    outs = pipe(texts, batch_size=2, return_full_text=False, **kwargs)
    for text, out in zip(texts, outs):
        ids = tokenizer(text, return_tensors="pt").input_ids
        alone = model.generate(ids, **kwargs)[0, ids.shape[1]:]
        assert out[0]["generated_text"] == tokenizer.decode(alone, skip_special_tokens=True)
