"""Remote-code shim written by hf-dllm-spec (0.1.0.dev0).

`model_patches.fast_dllm_v2.Fast_dLLM_QwenModel` and `model_patches.fast_dllm_v2.Fast_dLLM_QwenForCausalLM` live in the installed `hf-dllm-spec` package;
this file only imports them, so that
`AutoModel.from_pretrained(<this checkpoint>, trust_remote_code=True)` or
`AutoModelForCausalLM.from_pretrained(<this checkpoint>, trust_remote_code=True)`
works without `import hf_dllm_spec`.
"""

try:  # transformers' import check skips try blocks, so a missing package fails with the message below
    from model_patches.fast_dllm_v2 import Fast_dLLM_QwenModel as _Fast_dLLM_QwenModel, Fast_dLLM_QwenForCausalLM as _Fast_dLLM_QwenForCausalLM
except ImportError as error:
    raise ImportError(
        "This checkpoint's `Fast_dLLM_QwenModel` and `Fast_dLLM_QwenForCausalLM` come from the `hf-dllm-spec` package, which could not be "
        f"imported ({error}); install the hf-dllm-spec package from its repository checkout: pip install -e <checkout>"
    ) from error


class Fast_dLLM_QwenModel(_Fast_dLLM_QwenModel):
    """`model_patches.fast_dllm_v2.Fast_dLLM_QwenModel`, as this checkpoint's remote code."""


class Fast_dLLM_QwenForCausalLM(_Fast_dLLM_QwenForCausalLM):
    """`model_patches.fast_dllm_v2.Fast_dLLM_QwenForCausalLM`, as this checkpoint's remote code."""
