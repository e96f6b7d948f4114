"""A strategy anyone can add (issue 33): `examples/custom_strategy.py` registers `burst`, a block-diffusion strategy
with a parameter of its own, and it runs its own code with its own parameter through `model.generate` (a model
class), the `custom_generate` callable (a stock transformers model), the command line (found through the entry
point group of an installed package) and the server. Plus the registry's rules for a config class."""

from __future__ import annotations

import importlib.util
import os
import pathlib
import subprocess
import sys
from dataclasses import dataclass

import pytest
import torch

import hf_dllm_spec
from conftest import tiny_family_models
from hf_dllm_spec.strategies.block_diffusion import BlockDiffusionConfig, BlockDiffusionStrategy
from hf_dllm_spec.strategies.registry import STRATEGIES, register_strategy

ROOT = pathlib.Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
MODELS = ROOT / "models"
PROMPT = "Question: Tom has 3 apples. He gets 2 more. How many apples does Tom have now?\nAnswer:"


@pytest.fixture(scope="module")
def burst():
    """The example module, imported (which registers `burst`); the registry restored afterwards."""
    before = dict(STRATEGIES)
    spec = importlib.util.spec_from_file_location("custom_strategy", EXAMPLES / "custom_strategy.py")
    module = sys.modules["custom_strategy"] = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop("custom_strategy", None)
        STRATEGIES.clear()
        STRATEGIES.update(before)
        register_strategy(before["ar"])                  # refresh the routed keywords


@pytest.fixture(scope="module")
def bundled():
    from hf_dllm_spec.tools.jobs.evaluation import load

    return load(MODELS / "sdar-tiny-arith")


def _calls(monkeypatch, cls) -> list:
    seen = []
    original = cls.tokens_per_step

    def spy(self, block):
        seen.append(self.config.first_step_tokens)
        return original(self, block)

    monkeypatch.setattr(cls, "tokens_per_step", spy)
    return seen


def test_model_class_and_custom_generate_run_the_third_party_strategy(burst, bundled, qwen_model, sdar_model,
                                                                      monkeypatch, one_thread):
    tokenizer, model = bundled
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    seen = _calls(monkeypatch, burst.BurstStrategy)
    plain = model.generate(ids, decoding_strategy="block_diffusion", max_new_tokens=16, return_dict_in_generate=True)
    out = model.generate(ids, decoding_strategy="burst", first_step_tokens=3, max_new_tokens=16,
                         return_dict_in_generate=True)
    assert seen and set(seen) == {3}, "the strategy's own code with its own parameter"
    assert out.spec_stats.num_forward_calls < plain.spec_stats.num_forward_calls      # 3 commits per first step
    assert out.sequences.shape == plain.sequences.shape
    # the custom_generate callable on a stock transformers model (the SDAR weights in Qwen3ForCausalLM)
    prompt = torch.tensor([[5, 17, 42, 8, 23, 61, 4]])
    seen.clear()
    stock = qwen_model.generate(prompt, custom_generate=hf_dllm_spec.custom_generate, decoding_strategy="burst",
                                first_step_tokens=2, block_size=4, mask_token_id=98, max_new_tokens=8, eos_token_id=None)
    own = sdar_model.generate(prompt, decoding_strategy="burst", first_step_tokens=2, max_new_tokens=8,
                              eos_token_id=None)
    assert set(seen) == {2} and stock.tolist() == own.tolist()
    with pytest.raises(ValueError, match="first_step_tokens"):
        model.generate(ids, decoding_strategy="burst", first_step_tokens=0, max_new_tokens=8)


def test_a_config_without_its_own_name_runs_its_own_strategy(sdar_model, prompt, monkeypatch):
    """Before: a config subclass that did not set `decoding_strategy` ran the built-in block diffusion silently."""
    @dataclass
    class QuietConfig(BlockDiffusionConfig):
        quietness: float = 0.5

    class QuietStrategy(BlockDiffusionStrategy):
        name = "quiet"
        config_class = QuietConfig

        def decode(self):
            ran.append(self.config.quietness)
            return super().decode()

    ran = []
    before = dict(STRATEGIES)
    try:
        register_strategy(QuietStrategy)
        assert QuietConfig.decoding_strategy == "quiet"
        sdar_model.generate(prompt, decoding_strategy="quiet", strategy_config=QuietConfig(quietness=0.25),
                            max_new_tokens=4, eos_token_id=None)
        sdar_model.generate(prompt, decoding_strategy="quiet", quietness=0.75, max_new_tokens=4, eos_token_id=None)
        assert ran == [0.25, 0.75]

        class Borrowing(BlockDiffusionStrategy):
            name = "borrowing"
            config_class = BlockDiffusionConfig          # another strategy's own config
        with pytest.raises(ValueError, match="name the strategy it configures"):
            register_strategy(Borrowing)
    finally:
        STRATEGIES.clear()
        STRATEGIES.update(before)
        register_strategy(before["ar"])


def test_the_command_line_finds_an_installed_strategy(burst, bundled, tmp_path, one_thread):
    """An installed package that declares `burst` under the `hf_dllm_spec.strategies` entry points: the command line
    offers it with its own option and prints the tokens of `model.generate`."""
    site = tmp_path / "site"
    dist = site / "custom_strategy-0.1.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: custom-strategy\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text('[hf_dllm_spec.strategies]\nburst = custom_strategy:BurstStrategy\n')
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(site), str(EXAMPLES)]), HF_HUB_OFFLINE="1")
    command = [sys.executable, "-m", "hf_dllm_spec.cli", "generate", "--model", str(MODELS / "sdar-tiny-arith"),
               "--prompt", PROMPT, "--strategy", "burst", "--first-step-tokens", "3", "--max-new-tokens", "12"]
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    tokenizer, model = bundled
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    out = model.generate(ids, decoding_strategy="burst", first_step_tokens=3, max_new_tokens=12)
    expected = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    assert expected.strip() and expected.strip() in done.stdout


def test_the_server_serves_the_third_party_strategy(burst, one_thread):
    pytest.importorskip("fastapi")
    openai = pytest.importorskip("openai")
    from hf_dllm_spec.serving.app import create_app, load_served_model, serve_in_background

    served = load_served_model(str(MODELS / "sdar-tiny-arith"))
    ids = served.tokenizer(PROMPT).input_ids
    out = served.model.generate(torch.tensor([ids]), decoding_strategy="burst", first_step_tokens=3,
                                max_new_tokens=12, return_dict_in_generate=True)
    want = out.sequences[0, len(ids):][: out.spec_stats_per_row[0].num_generated_tokens].tolist()
    with serve_in_background(create_app(served)) as base:
        client = openai.OpenAI(base_url=base + "/v1", api_key="unused", timeout=60, max_retries=0)
        got = client.completions.create(model=served.name, prompt=PROMPT, max_tokens=12, temperature=0,
                                        extra_body={"decoding_strategy": "burst", "first_step_tokens": 3})
    assert got.choices[0].text == served.tokenizer.decode(want, skip_special_tokens=True)


@pytest.mark.parametrize("field", ["temperature", "max_new_tokens", "generator", "attention_mask"])
def test_a_parameter_named_like_a_generate_keyword_is_refused_and_nothing_changes(field, sdar_model, prompt):
    """Before: a parameter named like a transformers `generate` option (or an argument of the callable) took that
    keyword over for every strategy (`temperature=` then failed on the built-in ones), and a registration whose
    keyword refresh failed stayed in the registry and broke every later one."""
    config = dataclass(type("ClashConfig", (BlockDiffusionConfig,), {"__annotations__": {field: int}, field: 1}))
    strategy = type("ClashStrategy", (BlockDiffusionStrategy,), {"name": "clash", "config_class": config})
    before = dict(STRATEGIES)
    signature = hf_dllm_spec.dllm_generate.__signature__
    with pytest.raises(ValueError, match=rf"strategy parameter` \(='{field}'\).*rename the config field"):
        register_strategy(strategy)
    assert STRATEGIES == before and hf_dllm_spec.dllm_generate.__signature__ == signature
    assert "decoding_strategy" not in vars(config)                  # the config class as it was, too
    sampled = sdar_model.generate(prompt, decoding_strategy="block_diffusion", do_sample=True, temperature=0.7,
                                  generator=torch.Generator().manual_seed(0), max_new_tokens=4)
    assert sampled.shape[1] == prompt.shape[1] + 4


def test_a_registration_in_progress_does_not_change_the_keywords_of_a_running_call(sdar_model, prompt,
                                                                                  monkeypatch):
    """A call takes its strategy parameters from the keywords transformers routed (the callable's signature), not
    from the registry: a registration that is refused later held a clashing entry there meanwhile, and a call
    running then popped its `use_cache` / `attention_mask` as that strategy's parameters ("must be a parameter of
    decoding_strategy='s2d2'")."""
    config = dataclass(type("ClashConfig", (BlockDiffusionConfig,), {"__annotations__": {"use_cache": bool},
                                                                     "use_cache": True}))
    expected = sdar_model.generate(prompt, decoding_strategy="s2d2", max_new_tokens=8)
    monkeypatch.setitem(STRATEGIES, "clash", type("ClashStrategy", (BlockDiffusionStrategy,),
                                                  {"name": "clash", "config_class": config}))
    assert torch.equal(sdar_model.generate(prompt, decoding_strategy="s2d2", max_new_tokens=8, use_cache=True),
                       expected)


def test_a_clash_is_refused_before_generate_was_ever_imported():
    """In a fresh process, `register_strategy` before any `generate` call: the clash was checked only by the keyword
    refresh, which is not there yet, so it was accepted and every later call failed (for every strategy)."""
    script = f"""
import sys, torch, hf_dllm_spec
from dataclasses import dataclass
from transformers import AutoModelForCausalLM
from hf_dllm_spec.strategies.block_diffusion import BlockDiffusionConfig, BlockDiffusionStrategy
for field in ("use_cache", "row_feed"):          # a generate keyword, an argument of the callable
    config = dataclass(type("C", (BlockDiffusionConfig,), {{"__annotations__": {{field: bool}}, field: True}}))
    try:
        hf_dllm_spec.register_strategy(type("S", (BlockDiffusionStrategy,),
                                            {{"name": "clash", "config_class": config}}))
    except ValueError as err:
        print("refused:", err)
assert "hf_dllm_spec.integration.generate" not in sys.modules
hf_dllm_spec.register_auto_classes()
model = AutoModelForCausalLM.from_pretrained({str(MODELS / "sdar-tiny-arith")!r})
print("tokens:", model.generate(torch.tensor([[5, 17, 42]]), decoding_strategy="s2d2", max_new_tokens=4).shape)
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, HF_HUB_OFFLINE="1"))
    assert done.returncode == 0, done.stderr[-2000:]
    assert "refused: `strategy parameter` (='use_cache')" in done.stdout and "tokens: torch.Size([1, 7])" in done.stdout
    assert "refused: `strategy parameter` (='row_feed')" in done.stdout


def test_a_listener_that_fails_when_added_is_not_kept():
    """Kept, it failed every later registration (each rolled back)."""
    from hf_dllm_spec.strategies import registry

    listeners = list(registry._LISTENERS)
    with pytest.raises(ZeroDivisionError):
        registry.on_register(lambda: 1 / 0)
    assert registry._LISTENERS == listeners
    register_strategy(STRATEGIES["ar"])


def test_the_callable_arguments_the_registry_reserves_are_the_callables():
    from hf_dllm_spec.bridge import CALLABLE_ARGUMENTS
    from hf_dllm_spec.integration.generate import _BASE_SIGNATURE

    assert CALLABLE_ARGUMENTS == {name for name, p in _BASE_SIGNATURE.parameters.items() if p.kind is not p.VAR_KEYWORD}


@pytest.mark.parametrize("name", ["", " ", "s2d2 ", "my strategy"])
def test_a_name_with_spaces_is_refused(name):
    strategy = type("Spaced", (BlockDiffusionStrategy,), {"name": name, "config_class": BlockDiffusionConfig})
    before = dict(STRATEGIES)
    with pytest.raises(ValueError, match=r"`strategy.name` .* must be a non-empty string without spaces"):
        register_strategy(strategy)
    assert STRATEGIES == before


@pytest.mark.parametrize("field", ["dllm_decoding"])
def test_the_stored_strategy_key_is_no_parameter_name(field):
    config = dataclass(type("KeyConfig", (BlockDiffusionConfig,), {"__annotations__": {field: int}, field: 1}))
    strategy = type("KeyStrategy", (BlockDiffusionStrategy,), {"name": "key", "config_class": config})
    with pytest.raises(ValueError, match=field):
        register_strategy(strategy)
    assert "key" not in STRATEGIES


@pytest.mark.parametrize("field, value", [("target_kind", "ar"), ("drafter_kind", "same family")])
def test_a_model_kind_that_is_not_one_of_the_declared_ones_is_refused(field, value):
    """A misspelt kind would check nothing: refused at registration, naming the field and listing the kinds."""
    strategy = type("Kinded", (BlockDiffusionStrategy,), {"name": "kinded", "config_class": BlockDiffusionConfig,
                                                          field: value})
    before = dict(STRATEGIES)
    with pytest.raises(ValueError, match=rf"^`strategy.{field}` \(='{value}'\) must be one of 'any', "):
        register_strategy(strategy)
    assert STRATEGIES == before


@pytest.mark.parametrize("kind", ["diffusion", "same_family"])
def test_a_drafter_kind_without_a_drafter_and_a_check_models_hook_are_refused(kind):
    """A `drafter_kind` on a strategy that runs no drafter would check nothing; a `check_models` method (the hook the
    declared kinds replaced), its own or inherited, would never be called: each refused at registration, with the
    fix."""
    silent = type("Silent", (BlockDiffusionStrategy,), {"name": "silent", "config_class": BlockDiffusionConfig,
                                                        "drafter_kind": kind})
    hooked = type("Hooked", (BlockDiffusionStrategy,), {"name": "hooked", "config_class": BlockDiffusionConfig,
                                                        "check_models": classmethod(lambda cls, *models: None)})
    mixin = type("Mixin", (), {"check_models": classmethod(lambda cls, *models: None)})
    inherits = type("Inherits", (mixin, BlockDiffusionStrategy), {"name": "inherits",
                                                                  "config_class": BlockDiffusionConfig})
    before = dict(STRATEGIES)
    with pytest.raises(ValueError, match=rf"^`strategy.drafter_kind` \(='{kind}'\) must stay 'any' on a strategy "
                                         r"without a drafter"):
        register_strategy(silent)
    for strategy in (hooked, inherits):
        with pytest.raises(ValueError, match=rf"^`strategy.check_models` \(='{strategy.__name__}'\) must not be "
                                             r"defined: .* declare `target_kind` / `drafter_kind`"):
            register_strategy(strategy)
    assert STRATEGIES == before


def test_a_declared_target_kind_is_checked_by_the_plan_before_any_forward(sdar_model, prompt):
    """A third-party strategy states the target it decodes (`target_kind`) instead of checking the models itself:
    an autoregressive-only block strategy refuses the SDAR target, naming `model` and the strategy, before any
    forward; a right-shifted AR Qwen3 target (given a mask token and a block size) decodes with it."""
    @dataclass
    class ArOnlyConfig(BlockDiffusionConfig):
        pass

    class ArOnlyStrategy(BlockDiffusionStrategy):
        name = "ar_only"
        config_class = ArOnlyConfig
        target_kind = "autoregressive"

    forwards = []
    handle = sdar_model.register_forward_pre_hook(lambda module, args: forwards.append(1))
    before = dict(STRATEGIES)
    try:
        register_strategy(ArOnlyStrategy)
        with pytest.raises(ValueError, match=r"^`model` \(='SDARForCausalLM'\) must be an autoregressive causal LM "
                                             r"\(right-shifted, not a diffusion LM; e.g. Qwen2/Qwen3\) for "
                                             r"decoding_strategy='ar_only'"):
            sdar_model.generate(prompt, decoding_strategy="ar_only", max_new_tokens=4)
        with pytest.raises(ValueError) as info:
            sdar_model.generate(prompt, decoding_strategy="ar_only", max_new_tokens=4)
        assert str(info.value).endswith("; pass the AR model as the model.")      # no drafter to speak of
        assert not forwards
        out = tiny_family_models()["qwen"].generate(
            prompt, custom_generate=hf_dllm_spec.custom_generate, decoding_strategy="ar_only",
            mask_token_id=98, block_size=4, max_new_tokens=4, eos_token_id=None)
        assert out.shape == (1, prompt.shape[1] + 4)
    finally:
        handle.remove()
        STRATEGIES.clear()
        STRATEGIES.update(before)
        register_strategy(before["ar"])


def test_a_parameter_without_a_default_is_refused():
    """Before: a config field without a default passed registration, then every call (and the CLI's listing of all
    strategies) failed with a TypeError."""
    @dataclass(kw_only=True)
    class NeedyConfig(BlockDiffusionConfig):
        knob: int

    strategy = type("NeedyStrategy", (BlockDiffusionStrategy,), {"name": "needy", "config_class": NeedyConfig})
    before = dict(STRATEGIES)
    with pytest.raises(ValueError, match=r"NeedyConfig.knob` \(='<no default>'\) must have a default"):
        register_strategy(strategy)
    assert STRATEGIES == before


def test_the_callable_and_the_hub_folder_run_the_stored_strategy(qwen_model):
    """Without `decoding_strategy`, the custom_generate callable and the Hub folder run the strategy stored in the
    generation config (before: the folder ran "s2d2" whatever was stored, the callable raised a TypeError)."""
    from transformers import GenerationConfig

    from hf_dllm_spec import BlockDiffusionConfig as Stored

    prompt = torch.tensor([[5, 17, 42, 8, 23, 61, 4]])
    stored = Stored(block_size=4, confidence_threshold=0.5).save_to_generation_config(
        GenerationConfig(max_new_tokens=8, eos_token_id=None, mask_token_id=98))
    named = qwen_model.generate(prompt, custom_generate=hf_dllm_spec.custom_generate, generation_config=stored,
                                decoding_strategy="block_diffusion", block_size=4, confidence_threshold=0.5,
                                mask_token_id=98)
    by_callable = qwen_model.generate(prompt, custom_generate=hf_dllm_spec.custom_generate, generation_config=stored,
                                      mask_token_id=98)
    by_folder = qwen_model.generate(prompt, custom_generate=str(ROOT), trust_remote_code=True,
                                    generation_config=stored, mask_token_id=98)
    assert by_callable.tolist() == named.tolist() == by_folder.tolist()
    with pytest.raises(ValueError, match=r"`decoding_strategy` \(=None\) must be given, or stored"):
        qwen_model.generate(prompt, custom_generate=hf_dllm_spec.custom_generate, max_new_tokens=4, mask_token_id=98)


def test_an_unregistered_stored_strategy_is_named_as_stored(sdar_model, qwen_model):
    """A stored `dllm_decoding` naming no registered strategy (an uninstalled plugin) is refused under the stored
    key on every entry point; the caller passed no `decoding_strategy` (before: "`decoding_strategy` (='mine')")."""
    from transformers import GenerationConfig

    stored = GenerationConfig(max_new_tokens=4, eos_token_id=None, mask_token_id=98)
    stored.dllm_decoding = {"decoding_strategy": "uninstalled"}
    prompt = torch.tensor([[5, 17, 42, 8]])
    rule = r"`generation_config.dllm_decoding\['decoding_strategy'\]` \(='uninstalled'\) must name a registered"
    for call in (lambda: sdar_model.generate(prompt, generation_config=stored),
                 lambda: qwen_model.generate(prompt, custom_generate=hf_dllm_spec.custom_generate,
                                             generation_config=stored),
                 lambda: qwen_model.generate(prompt, custom_generate=str(ROOT), trust_remote_code=True,
                                             generation_config=stored)):
        with pytest.raises(ValueError, match=rule):
            call()
    with pytest.raises(ValueError, match=r"`decoding_strategy` \(='other'\) must be one of"):
        sdar_model.generate(prompt, generation_config=stored, decoding_strategy="other")
