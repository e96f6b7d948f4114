"""This checkpoint's tokenizer exactly as trained: `tokenizer.json` loaded unchanged (transformers' own
`TokenizersBackend`; nothing here imports hf-dllm-spec).

transformers maps every `qwen2` checkpoint to `Qwen2Tokenizer`, which rebuilds the pre-tokenizer with Qwen2's
regex and so splits code differently from the tokenizer this model was trained with ("def add(a, b):\\n    return
a + b\\n": 14 ids instead of 13). `tokenizer_config.json` names this class in its `auto_map`, which keeps
`AutoTokenizer` on the saved `tokenizer.json`: without `trust_remote_code` transformers then loads the declared
`tokenizer_class` (`TokenizersBackend`) with no prompt; with `trust_remote_code=True` it loads this subclass,
which changes nothing.
"""

from transformers import TokenizersBackend


class TrainedTokenizer(TokenizersBackend):
    """`transformers.TokenizersBackend` over this checkpoint's `tokenizer.json`, as saved."""
