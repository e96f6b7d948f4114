"""The loading options `generate` and `serve` share (`hf_dllm_spec.serving.loading`): what reaches
`from_pretrained`, the combinations refused before loading, and bitsandbytes weights end to end on the CPU."""

from __future__ import annotations

import importlib.util
import pathlib

import pytest
import torch
import transformers

from hf_dllm_spec.cli import main
from hf_dllm_spec.serving.loading import LoadOptions, load_models

MODELS = pathlib.Path(__file__).resolve().parents[1] / "models"
MODEL, DRAFTER = str(MODELS / "sdar-tiny-arith"), str(MODELS / "sdar-tiny-arith")
PROMPT = "Question: 1 + 1?\nAnswer:"


@pytest.fixture
def calls(monkeypatch):
    """Record every `AutoModelForCausalLM.from_pretrained` call; load the checkpoint plainly (float32, no map)."""
    recorded = []
    original = transformers.AutoModelForCausalLM.from_pretrained.__func__

    def fake(cls, path, **kwargs):
        recorded.append((str(path), kwargs))
        return original(cls, path, dtype=torch.float32)

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", classmethod(fake))
    return recorded


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_loading_options_reach_from_pretrained(calls, monkeypatch, capsys, command):
    """`--quantization 4bit --device-map auto --dtype auto --draft-device cpu` on both commands: the target gets
    `BitsAndBytesConfig(load_in_4bit)`, the device map and dtype "auto"; the drafter neither quantization nor
    map."""
    pytest.importorskip("accelerate")
    if importlib.util.find_spec("bitsandbytes") is None:
        pytest.skip("bitsandbytes is not installed")
    options = ["--quantization", "4bit", "--device-map", "auto", "--dtype", "auto", "--draft-model", DRAFTER,
               "--draft-device", "cpu"]
    if command == "generate":
        main(["generate", "--model", MODEL, "--prompt", PROMPT, "--strategy", "simsd", "--max-new-tokens", "4",
              *options])
    else:
        pytest.importorskip("uvicorn")
        import uvicorn

        monkeypatch.setattr(uvicorn, "run", lambda app, **kwargs: None)        # load, do not serve
        main(["serve", MODEL, "--strategy", "simsd", *options])
    (target_path, target), (draft_path, draft) = calls
    assert (target_path, draft_path) == (MODEL, DRAFTER)
    config = target["quantization_config"]
    assert isinstance(config, transformers.BitsAndBytesConfig) and config.load_in_4bit and not config.load_in_8bit
    assert config.bnb_4bit_compute_dtype == torch.float32
    assert target["device_map"] == "auto" and target["dtype"] == "auto"
    assert "quantization_config" not in draft and "device_map" not in draft and draft["dtype"] == "auto"


def test_quantized_target_without_a_map_is_loaded_on_its_device(calls):
    load_models(MODEL, None, LoadOptions(dtype="bfloat16", quantization="8bit", device="cpu"))
    (_, kwargs), = calls
    assert kwargs["quantization_config"].load_in_8bit and kwargs["device_map"] == {"": "cpu"}
    assert kwargs["dtype"] == torch.bfloat16


def test_device_map_json_object(calls):
    load_models(MODEL, None, LoadOptions.from_args(_args(device_map='{"": "cpu"}')))
    assert calls[0][1]["device_map"] == {"": "cpu"}


def _args(**changes):
    import argparse

    base = dict(dtype="float32", device=None, device_map=None, quantization=None, draft_device=None)
    return argparse.Namespace(**{**base, **changes})


@pytest.mark.parametrize("argv, message", [
    (["--quantization", "8bit"], "argument --quantization: 8bit (LLM.int8) runs 16-bit activations"),
    (["--device", "cpu", "--device-map", "auto"], "argument --device-map: places the model itself: drop --device"),
    (["--device-map", "{not json"], "argument --device-map: is not a JSON object"),
    (["--dtype", "float64"], "argument --dtype: invalid choice"),
    (["--quantization", "3bit"], "argument --quantization: invalid choice"),
])
@pytest.mark.parametrize("command", ["generate", "serve"])
def test_bad_loading_options_are_usage_errors_before_loading(calls, capsys, argv, message, command):
    line = (["generate", "--model", MODEL, "--prompt", PROMPT] if command == "generate" else ["serve", MODEL])
    with pytest.raises(SystemExit) as exit_info:
        main([*line, *argv])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err
    assert calls == []                                   # nothing was loaded


def test_quantization_without_bitsandbytes_names_the_extra(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "bitsandbytes" else
                        real(name, *a))
    with pytest.raises(ValueError, match=r"--quantization: needs bitsandbytes: pip install -e '<checkout>\[quant\]'"):
        LoadOptions(dtype="bfloat16", quantization="8bit").check()


@pytest.mark.slow
@pytest.mark.parametrize("quantization, dtype", [("4bit", "float32"), ("8bit", "bfloat16")])
def test_quantized_generate_runs_on_the_cpu(one_thread, capsys, quantization, dtype):
    """bitsandbytes weights for real (its CPU kernels): `generate --quantization` prints text and the library's
    check of quantized weights passes."""
    if importlib.util.find_spec("bitsandbytes") is None:
        pytest.skip("bitsandbytes is not installed")
    tokenizer, model, _ = load_models(MODEL, None, LoadOptions(dtype=dtype, quantization=quantization))
    assert any(type(m).__name__ in ("Linear4bit", "Linear8bitLt") for m in model.modules())
    main(["generate", "--model", MODEL, "--prompt", PROMPT, "--strategy", "block_diffusion", "--max-new-tokens", "4",
          "--quantization", quantization, "--dtype", dtype])
    assert capsys.readouterr().out.strip()
