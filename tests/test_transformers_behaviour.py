"""Where users rely on transformers' `generate` behaviour: stop ids, stopping criteria, stop strings, token
healing, and native diffusion decoding when no strategy is named."""

from __future__ import annotations

import pathlib

import pytest
import torch
from conftest import MASK_ID, TINY
from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM, StoppingCriteria, StoppingCriteriaList

import hf_dllm_spec
from hf_dllm_spec import BlockDiffusionConfig, S2D2Config
from model_patches.sdar import SDARConfig, SDARForCausalLM

BUNDLED = pathlib.Path(__file__).resolve().parents[1] / "models" / "sdar-tiny-arith"
PROMPT = torch.tensor([[5, 17, 42, 8, 23, 61, 4]])


class StopAtLength(StoppingCriteria):
    """Fires once the sequence holds `length` tokens (a criterion that may fire anywhere inside a block)."""

    def __init__(self, length: int) -> None:
        self.length = length

    def __call__(self, input_ids, scores, **kwargs):
        return torch.full((input_ids.shape[0],), input_ids.shape[1] >= self.length)


@pytest.fixture(scope="module")
def eos_model():
    """The tiny SDAR model with a stop id in its generation config."""
    torch.manual_seed(0)
    model = SDARForCausalLM(SDARConfig(block_size=4, mask_token_id=MASK_ID, **TINY)).eval()
    return model


def test_eos_none_disables_stopping_as_in_stock_generate(eos_model):
    free = eos_model.generate(PROMPT, decoding_strategy="block_diffusion", max_new_tokens=16, eos_token_id=None)
    new = free[0, PROMPT.shape[1]:]
    stop = int(new[2])                                    # a token the model does produce early
    eos_model.generation_config.eos_token_id = stop
    try:
        stopped = eos_model.generate(PROMPT, decoding_strategy="block_diffusion", max_new_tokens=16)
        assert stopped[0, -1] == stop and stopped.shape[1] <= PROMPT.shape[1] + 3
        unstopped = eos_model.generate(PROMPT, decoding_strategy="block_diffusion", max_new_tokens=16,
                                       eos_token_id=None)
        assert torch.equal(unstopped, free)
        # stock transformers does the same on an AR model: eos_token_id=None runs the whole budget
        torch.manual_seed(0)                            # reproducible weights
        qwen = Qwen3ForCausalLM(Qwen3Config(**TINY)).eval()
        qwen.generation_config.eos_token_id = stop
        stock = qwen.generate(PROMPT, max_new_tokens=16, do_sample=False, eos_token_id=None)
        assert stock.shape[1] == PROMPT.shape[1] + 16
    finally:
        eos_model.generation_config.eos_token_id = None


@pytest.mark.parametrize("strategy", ["block_diffusion", "s2d2"])
def test_stopping_criteria_cut_at_the_exact_token(sdar_model, strategy):
    free = sdar_model.generate(PROMPT, decoding_strategy=strategy, max_new_tokens=16, eos_token_id=None)
    # the 6th new token sits at position 12, the first of the block 12..15: the rest of that block is dropped
    out = sdar_model.generate(PROMPT, decoding_strategy=strategy, max_new_tokens=16, eos_token_id=None,
                              stopping_criteria=StoppingCriteriaList([StopAtLength(PROMPT.shape[1] + 6)]))
    assert torch.equal(out, free[:, : PROMPT.shape[1] + 6])


class StopOnScores(StoppingCriteria):
    """Reads `scores`, as a criterion written for stock AR decoding may."""

    def __call__(self, input_ids, scores, **kwargs):
        return scores.argmax(-1) == 5


@pytest.mark.parametrize("strategy", ["ar", "s2d2"])
def test_a_criterion_that_reads_scores_gets_the_librarys_error(sdar_model, strategy):
    """Criteria are called with scores=None (not defined for out-of-order commits); one that reads them fails with
    the library's error naming `stopping_criteria`, the original error chained."""
    with pytest.raises(ValueError, match=r"`stopping_criteria` \(='StopOnScores'\) must judge from `input_ids` "
                                         r"alone: they are called with scores=None") as info:
        sdar_model.generate(PROMPT, decoding_strategy=strategy, max_new_tokens=8, eos_token_id=None,
                            stopping_criteria=StoppingCriteriaList([StopOnScores()]))
    assert isinstance(info.value.__cause__, AttributeError)


def test_no_strategy_runs_native_diffusion_decoding(sdar_model):
    native = sdar_model.generate(PROMPT, max_new_tokens=12, eos_token_id=None)
    explicit = sdar_model.generate(PROMPT, decoding_strategy="block_diffusion", max_new_tokens=12, eos_token_id=None)
    assert torch.equal(native, explicit)
    assert sdar_model.default_decoding_strategy() == "block_diffusion"


def test_no_strategy_uses_the_stored_strategy_and_parameters(sdar_model):
    stored = S2D2Config(confidence_threshold=0.6, min_ssd_span_length=1)
    gc = stored.save_to_generation_config(GenerationConfig(eos_token_id=None, max_new_tokens=12))
    out = sdar_model.generate(PROMPT, generation_config=gc, return_dict_in_generate=True)
    explicit = sdar_model.generate(PROMPT, decoding_strategy="s2d2", confidence_threshold=0.6, min_ssd_span_length=1,
                                   max_new_tokens=12, eos_token_id=None, return_dict_in_generate=True)
    assert torch.equal(out.sequences, explicit.sequences)
    assert out.spec_stats.num_verify_forwards == explicit.spec_stats.num_verify_forwards > 0
    # stored on the model's own generation config, it is the model's default
    saved = sdar_model.generation_config
    try:
        sdar_model.generation_config = BlockDiffusionConfig(confidence_threshold=1.0).save_to_generation_config(
            GenerationConfig(eos_token_id=None))
        static = sdar_model.generate(PROMPT, max_new_tokens=12)
        assert torch.equal(static, sdar_model.generate(PROMPT, decoding_strategy="block_diffusion",
                                                       confidence_threshold=1.0, max_new_tokens=12))
    finally:
        sdar_model.generation_config = saved


def test_stored_strategy_survives_save_pretrained(sdar_model, tmp_path):
    """Defaults stored on a model's own generation config (derived from its model config, so marked
    `_from_model_config`) are written by `save_pretrained` and read back by `from_pretrained` (transformers dropped
    the key on load: the reloaded model ran its native strategy)."""
    import copy

    saved = sdar_model.generation_config
    try:
        sdar_model.generation_config = S2D2Config(confidence_threshold=0.6, min_ssd_span_length=1) \
            .save_to_generation_config(copy.deepcopy(saved))
        sdar_model.save_pretrained(tmp_path)
    finally:
        sdar_model.generation_config = saved
    reloaded = SDARForCausalLM.from_pretrained(tmp_path).eval()
    assert reloaded.default_decoding_strategy() == "s2d2"
    explicit = sdar_model.generate(PROMPT, decoding_strategy="s2d2", confidence_threshold=0.6, min_ssd_span_length=1,
                                   max_new_tokens=12, eos_token_id=None)
    assert torch.equal(reloaded.generate(PROMPT, max_new_tokens=12, eos_token_id=None), explicit)


@pytest.mark.parametrize("name", ["sdar-tiny-arith", "fast-dllm-v2-tiny", "llada2-tiny"])
def test_auto_classes_load_every_family_as_transformers_users_do(name):
    """`AutoModel` gives the family's decoder stack (SDAR was refused) with the causal LM's weights, and
    `output_loading_info=True` returns `(model, info)` with nothing missing (Fast-dLLM v2 and LLaDA2 failed)."""
    from transformers import AutoModel, AutoModelForCausalLM

    path = pathlib.Path(__file__).resolve().parents[1] / "models" / name
    hf_dllm_spec.register_auto_classes()
    model, info = AutoModelForCausalLM.from_pretrained(path, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    assert model.config.mask_token_id is not None
    stack = AutoModel.from_pretrained(path)
    assert isinstance(stack, type(model.model))
    assert all(torch.equal(v, model.model.state_dict()[k]) for k, v in stack.state_dict().items())


def test_plain_ar_models_keep_stock_generate():
    """A transformers Qwen model is untouched; `custom_generate` without a strategy is transformers' own call."""
    torch.manual_seed(0)                                # reproducible weights
    qwen = Qwen3ForCausalLM(Qwen3Config(**TINY)).eval()
    stock = qwen.generate(PROMPT, max_new_tokens=6, do_sample=False)
    assert stock.shape[1] == PROMPT.shape[1] + 6
    via_ar = qwen.generate(PROMPT, custom_generate=hf_dllm_spec.custom_generate, decoding_strategy="ar",
                           max_new_tokens=6)
    assert torch.equal(stock, via_ar)


@pytest.mark.parametrize("options", [dict(renormalize_logits=True), dict(remove_invalid_values=True),
                                     dict(top_h=0.5), dict(bad_words_ids="first")],
                         ids=["renormalize_logits", "remove_invalid_values", "top_h", "single-token bad_words_ids"])
def test_more_position_independent_options_run_as_stock(options):
    """Options whose processors read each position's logits alone were refused (`top_h` and `renormalize_logits`
    under the name `logits_processor`): the library's AR gives stock transformers' seeded tokens with them, and
    S2D2 never emits a bad word; multi-token bad words stay refused under their own name."""
    torch.manual_seed(0)                                # reproducible weights
    qwen = Qwen3ForCausalLM(Qwen3Config(**TINY)).eval()
    first = qwen.generate(PROMPT, max_new_tokens=1, do_sample=False)[0, -1].item()
    options = {"bad_words_ids": [[first]]} if options == dict(bad_words_ids="first") else options
    runs = []
    for custom in ({}, dict(custom_generate=hf_dllm_spec.custom_generate, decoding_strategy="ar")):
        torch.manual_seed(7)
        runs.append(qwen.generate(PROMPT, max_new_tokens=8, do_sample=True, **custom, **options))
    assert torch.equal(runs[0], runs[1])
    if "bad_words_ids" in options:
        sdar = SDARForCausalLM(SDARConfig(block_size=4, mask_token_id=MASK_ID, **TINY)).eval()
        out = sdar.generate(PROMPT, decoding_strategy="s2d2", max_new_tokens=12, eos_token_id=None, **options)
        assert first not in out[0, PROMPT.shape[1]:].tolist()
        with pytest.raises(NotImplementedError, match="`bad_words_ids`"):
            sdar.generate(PROMPT, decoding_strategy="s2d2", max_new_tokens=4, bad_words_ids=[[first, 3]])


@pytest.fixture(scope="module")
def bundled():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(BUNDLED)
    model = AutoModelForCausalLM.from_pretrained(BUNDLED, dtype=torch.float32).eval()
    return model, tokenizer


@pytest.mark.slow
def test_stop_strings_cut_at_the_exact_token_on_the_bundled_model(bundled):
    model, tokenizer = bundled
    ids = tokenizer("Tom has 5 apples and buys 7 more. How many apples does he have now?\n",
                    return_tensors="pt").input_ids
    free = model.generate(ids, decoding_strategy="block_diffusion", max_new_tokens=40)
    text = tokenizer.decode(free[0, ids.shape[1]:])
    assert " answer" in text
    out = model.generate(ids, decoding_strategy="block_diffusion", max_new_tokens=40, stop_strings=[" answer"],
                         tokenizer=tokenizer)
    new = out[0, ids.shape[1]:]
    assert tokenizer.decode(new).endswith(" answer") and torch.equal(new, free[0, ids.shape[1]:][: new.shape[0]])


@pytest.mark.slow
def test_token_healing_with_tokenizer(bundled):
    """`token_healing=True` with `tokenizer=` runs transformers' healing (dropped on the custom_generate path):
    the prompt's tail token is regenerated among its extensions, then decoding continues from the healed prompt."""
    model, tokenizer = bundled
    tokenizer = type(tokenizer).from_pretrained(BUNDLED)
    tokenizer.bos_token = "<|endoftext|>"                # transformers' heal_tokens needs a BOS id
    ids = tokenizer("def add(a, b):\n    ret", return_tensors="pt").input_ids
    tail = tokenizer.convert_ids_to_tokens(int(ids[0, -1]))
    out = model.generate(ids, max_new_tokens=6, token_healing=True, tokenizer=tokenizer)
    healed = model.heal_tokens(ids, tokenizer)
    assert tokenizer.convert_ids_to_tokens(int(healed[0, -1])).startswith(tail)
    assert torch.equal(out[0, : healed.shape[1]], healed[0])
    assert torch.equal(out, model.generate(healed, max_new_tokens=6))
    with pytest.raises(ValueError, match="`tokenizer`"):
        model.generate(ids, max_new_tokens=6, token_healing=True)


def test_default_criteria_are_decided_by_the_budget_and_the_stop_ids():
    """transformers' own `MaxLengthCriteria` (prompt + budget) and `EosTokenCriteria` (the stop ids) fire exactly
    where a row ends anyway, so the loop does not call them; a shorter max length, other eos ids, subclasses and
    custom criteria are still called."""
    from transformers import EosTokenCriteria, MaxLengthCriteria

    from hf_dllm_spec.integration.generate import criteria_to_scan

    class MyMaxLength(MaxLengthCriteria):
        pass

    custom = StopAtLength(9)
    kept = criteria_to_scan(StoppingCriteriaList([MaxLengthCriteria(7 + 16), EosTokenCriteria([2, 5]), custom]),
                            stop_ids=[2, 5, 8], prompt_width=7, max_new_tokens=16)
    assert list(kept) == [custom]
    shorter, other_eos, subclass = MaxLengthCriteria(7 + 15), EosTokenCriteria(9), MyMaxLength(7 + 16)
    kept = criteria_to_scan([shorter, other_eos, subclass], stop_ids=[2], prompt_width=7, max_new_tokens=16)
    assert list(kept) == [shorter, other_eos, subclass]
    assert len(criteria_to_scan(None, [2], 7, 16)) == 0


def test_explicit_default_criteria_give_the_same_tokens(sdar_model):
    """Passing the criteria transformers would add anyway (budget, eos) changes nothing, the shorter max length
    cuts as stock `generate` does."""
    from transformers import EosTokenCriteria, MaxLengthCriteria

    free = sdar_model.generate(PROMPT, decoding_strategy="s2d2", max_new_tokens=12, eos_token_id=None)
    stop = int(free[0, PROMPT.shape[1] + 5])
    plain = sdar_model.generate(PROMPT, decoding_strategy="s2d2", max_new_tokens=12, eos_token_id=stop)
    other = [StopAtLength(PROMPT.shape[1] + 30)]             # a custom criterion keeps the scan on
    scanned = sdar_model.generate(PROMPT, decoding_strategy="s2d2", max_new_tokens=12, eos_token_id=stop,
                                  stopping_criteria=StoppingCriteriaList(other + [EosTokenCriteria(stop)]))
    assert torch.equal(plain, scanned)
    cut = sdar_model.generate(PROMPT, decoding_strategy="s2d2", max_new_tokens=12, eos_token_id=None,
                              stopping_criteria=StoppingCriteriaList([MaxLengthCriteria(PROMPT.shape[1] + 3)]))
    assert torch.equal(cut, free[:, :PROMPT.shape[1] + 3])
