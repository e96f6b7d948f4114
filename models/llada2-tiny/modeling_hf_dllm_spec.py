"""Remote-code shim written by hf-dllm-spec (0.1.0.dev0).

The classes below live in the installed `hf-dllm-spec` package (`model_patches.llada2`); this file only
imports them, so that `AutoModel` / `AutoModelForCausalLM` loads this checkpoint with `trust_remote_code=True`
without `import hf_dllm_spec`.
"""

try:  # transformers' import check skips try blocks, so a missing package fails with the message below
    from model_patches.llada2 import LLaDA2MoeModel as _LLaDA2MoeModel
    from model_patches.llada2 import LLaDA2MoeModelLM as _LLaDA2MoeModelLM
except ImportError as error:
    raise ImportError(
        "This checkpoint's classes come from the `hf-dllm-spec` package, which could not be "
        f"imported ({error}); "
        "install the hf-dllm-spec package from its repository checkout: pip install -e <checkout>"
    ) from error


class LLaDA2MoeModel(_LLaDA2MoeModel):
    """`model_patches.llada2.LLaDA2MoeModel`, as this checkpoint's remote code."""


class LLaDA2MoeModelLM(_LLaDA2MoeModelLM):
    """`model_patches.llada2.LLaDA2MoeModelLM`, as this checkpoint's remote code."""
