"""Remote-code shim written by hf-dllm-spec (0.1.0.dev0).

The classes below live in the installed `hf-dllm-spec` package (`model_patches.sdar`); this file only
imports them, so that `AutoConfig` loads this checkpoint with `trust_remote_code=True`
without `import hf_dllm_spec`.
"""

try:  # transformers' import check skips try blocks, so a missing package fails with the message below
    from model_patches.sdar import SDARConfig as _SDARConfig
except ImportError as error:
    raise ImportError(
        "This checkpoint's classes come from the `hf-dllm-spec` package, which could not be "
        f"imported ({error}); "
        "install the hf-dllm-spec package from its repository checkout: pip install -e <checkout>"
    ) from error


class SDARConfig(_SDARConfig):
    """`model_patches.sdar.SDARConfig`, as this checkpoint's remote code."""

    def __init__(self, **kwargs):  # without it, transformers' generated __init__ would skip the family's
        super().__init__(**kwargs)
