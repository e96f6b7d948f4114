"""Hub `custom_generate` entry point: hf_dllm_spec strategies for any supported model.

    model.generate(ids, custom_generate="<this repo or directory>", trust_remote_code=True,
                   decoding_strategy="s2d2", max_new_tokens=64)

transformers loads this file and calls `generate(model=..., inputs=..., <generate arguments>)`; it hands the
call back to the stock `generate` with hf_dllm_spec's callable, so input preparation, logits processors,
stopping criteria, `streamer` and `assistant_model` stay transformers' own. Requires the `hf-dllm-spec`
package (requirements.txt).
"""

from transformers import GenerationMixin

import hf_dllm_spec


def generate(inputs=None, *, model, decoding_strategy="s2d2", **kwargs):
    """Decode `inputs` `(N, prompt_len)` (left-padded, with `attention_mask`) with `decoding_strategy`.

    Returns what `hf_dllm_spec.custom_generate` returns: the sequences, or a `GenerateDllmOutput` with
    `spec_stats` when `return_dict_in_generate=True`.
    """
    from hf_dllm_spec.mixin import stop_strings_as_criteria

    return GenerationMixin.generate(model, inputs, custom_generate=hf_dllm_spec.custom_generate,
                                    decoding_strategy=decoding_strategy, **stop_strings_as_criteria(kwargs))
