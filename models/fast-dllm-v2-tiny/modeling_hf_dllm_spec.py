"""Remote-code shim written by hf-dllm-spec (0.1.0.dev0).

The classes below live in the installed `hf-dllm-spec` package (`model_patches.fast_dllm_v2`); this file only
imports them, so that `AutoModel` / `AutoModelForCausalLM` loads this checkpoint with `trust_remote_code=True`
without `import hf_dllm_spec`.
"""

try:  # transformers' import check skips try blocks, so a missing package fails with the message below
    from model_patches.fast_dllm_v2 import Fast_dLLM_QwenModel as _Fast_dLLM_QwenModel
    from model_patches.fast_dllm_v2 import Fast_dLLM_QwenForCausalLM as _Fast_dLLM_QwenForCausalLM
except ImportError as error:
    raise ImportError(
        "This checkpoint's classes come from the `hf-dllm-spec` package, which could not be "
        f"imported ({error}); "
        "install the hf-dllm-spec package from its repository checkout: pip install -e <checkout>"
    ) from error


class Fast_dLLM_QwenModel(_Fast_dLLM_QwenModel):
    """`model_patches.fast_dllm_v2.Fast_dLLM_QwenModel`, as this checkpoint's remote code."""


class Fast_dLLM_QwenForCausalLM(_Fast_dLLM_QwenForCausalLM):
    """`model_patches.fast_dllm_v2.Fast_dLLM_QwenForCausalLM`, as this checkpoint's remote code."""
