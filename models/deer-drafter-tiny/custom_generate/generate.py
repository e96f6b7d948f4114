"""Hub `custom_generate` entry point: hf_dllm_spec strategies for any supported model.

    model.generate(ids, custom_generate="<this repo or directory>", trust_remote_code=True,
                   decoding_strategy="s2d2", max_new_tokens=64)

transformers loads this file and calls `generate(model=..., inputs=..., <generate arguments>)`; it hands the
call back to the stock `generate` with hf_dllm_spec's callable, so input preparation, logits processors,
stopping criteria, `streamer` and `assistant_model` stay transformers' own. Requires the `hf-dllm-spec`
package (requirements.txt).

The single source of this file is `hf_dllm_spec/hub/custom_generate/` in the hf-dllm-spec package;
`hf_dllm_spec.export_checkpoint` copies it into every exported checkpoint.
"""

try:  # transformers' import check skips try blocks, so a missing package fails with the message below
    from hf_dllm_spec.integration.mixin import DllmGenerationMixin, generate_with_strategy
    from model_patches.generation import positional_as_keywords, stored_decoding_strategy
except ImportError as error:
    raise ImportError(
        f"This custom_generate folder runs the `hf-dllm-spec` package, which could not be imported ({error}); "
        "install the hf-dllm-spec package from its repository checkout: pip install -e <checkout>"
    ) from error


def generate(inputs=None, *args, model, decoding_strategy=None, **kwargs):
    """Decode `inputs` `(N, prompt_len)` (left-padded, with `attention_mask`) with `decoding_strategy`; the other
    positional arguments are stock `generate`'s (`generation_config`, `logits_processor`, ...).

    A model class with hf_dllm_spec's `generate` (e.g. SDAR) runs it unchanged, so a checkpoint whose own
    `custom_generate/` transformers binds at `from_pretrained(..., trust_remote_code=True)` decodes as the
    class does (its own default without `decoding_strategy`). Any other model decodes with
    `decoding_strategy`; without it, with the strategy stored in the generation config (the call's, else the
    model's `dllm_decoding`); without either, a model that has a mask token (`mask_token_id=`,
    `config.mask_token_id` or `generation_config.mask_token_id`) decodes with "s2d2", one without (an
    autoregressive checkpoint such as a stock Qwen2 whose own folder transformers bound) keeps transformers' own
    `generate`.

    Returns what `hf_dllm_spec.custom_generate` returns: the sequences, or a `GenerateDllmOutput` with
    `spec_stats` when `return_dict_in_generate=True`.
    """
    args, kwargs = positional_as_keywords((inputs, *args), kwargs)   # stock generate's positional arguments
    if isinstance(model, DllmGenerationMixin):  # the class's own generate, not this function bound to the model
        return type(model).generate(model, *args, decoding_strategy=decoding_strategy, **kwargs)
    if decoding_strategy is None:
        decoding_strategy = stored_decoding_strategy(kwargs.get("generation_config"), model.generation_config)
    mask_ids = (kwargs.get("mask_token_id"), getattr(model.config, "mask_token_id", None),
                getattr(model.generation_config, "mask_token_id", None))
    if decoding_strategy is None and all(mask_id is None for mask_id in mask_ids):
        return type(model).generate(model, *args, **kwargs)  # an AR model without a strategy: stock generate
    return generate_with_strategy(model, args, kwargs, "s2d2" if decoding_strategy is None else decoding_strategy)
