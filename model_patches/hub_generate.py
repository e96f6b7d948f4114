"""What the families' Hub code does differently at the edges: its `generate` keywords and a mask token kept only in
the tokenizer files. Shared by the families whose Hub `generate` this library replaces (Fast-dLLM v2, LLaDA2).
"""

from __future__ import annotations

import json
import os
from typing import Any, ClassVar

#: Files of a checkpoint that may name the mask token with its id, in the order they are read.
TOKENIZER_FILES = ("tokenizer.json", "added_tokens.json", "tokenizer_config.json")
#: `from_pretrained` keywords that locate a checkpoint's files on the Hub.
HUB_FILE_KWARGS = ("revision", "cache_dir", "local_files_only", "token", "subfolder")


def mask_token_from_files(name_or_path: str | os.PathLike, token: str, **hub_kwargs) -> int | None:
    """The id of the special token `token` in the tokenizer files of a checkpoint (local directory or Hub id), or
    `None`.

    Reads `tokenizer.json` (`added_tokens`), `added_tokens.json` and `tokenizer_config.json`
    (`added_tokens_decoder`) as JSON; loads no tokenizer. Hub files come through transformers' `cached_file`
    (`hub_kwargs`: `revision`, `cache_dir`, `local_files_only`, ...); a missing file is skipped.
    """
    from transformers.utils import cached_file

    for name in TOKENIZER_FILES:
        path = cached_file(str(name_or_path), name, _raise_exceptions_for_missing_entries=False,
                           _raise_exceptions_for_connection_errors=False, **hub_kwargs)
        if path is None:
            continue
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        if name == "tokenizer.json":
            entries = {t.get("content"): t.get("id") for t in data.get("added_tokens", [])}
        elif name == "added_tokens.json":
            entries = data
        else:
            entries = {v.get("content"): int(k) for k, v in data.get("added_tokens_decoder", {}).items()}
        if entries.get(token) is not None:
            return int(entries[token])
    return None


class MaskTokenFromFilesMixin:
    """`from_pretrained` that sets an unset `config.mask_token_id` from the tokenizer files (`hub_mask_token`),
    for families whose Hub configs carry no mask id. Put it first among the model class's bases."""

    hub_mask_token: ClassVar[str] = ""

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):
        """`PreTrainedModel.from_pretrained`, then `config.mask_token_id` from the tokenizer files if unset
        (also under `output_loading_info=True`, which returns `(model, loading_info)`)."""
        loaded = super().from_pretrained(pretrained_model_name_or_path, *args, **kwargs)
        model = loaded[0] if isinstance(loaded, tuple) else loaded
        if getattr(model.config, "mask_token_id", None) is None:
            hub_kwargs = {k: kwargs[k] for k in HUB_FILE_KWARGS if k in kwargs}
            model.config.mask_token_id = mask_token_from_files(pretrained_model_name_or_path, cls.hub_mask_token,
                                                               **hub_kwargs)
        return loaded


def rename_hub_keywords(kwargs: dict[str, Any], names: dict[str, str]) -> dict[str, Any]:
    """A copy of `kwargs` with each Hub keyword of `names` (Hub name -> this library's) renamed.

    Raises:
        ValueError: a Hub keyword given together with the name it maps to (e.g. `threshold` and
            `confidence_threshold`).
    """
    out = dict(kwargs)
    for hub, ours in names.items():
        if hub in out and hub != ours:
            if ours in out:
                raise ValueError(f"`{hub}` (={out[hub]!r}) and `{ours}` (={out[ours]!r}) name the same parameter; "
                                 f"pass only one of them (`{hub}` is the Hub keyword, `{ours}` this library's).")
            out[ours] = out.pop(hub)
    return out


def hub_temperature(kwargs: dict[str, Any], default_top_p: float | None = None) -> dict[str, Any]:
    """The Hub's sampling switch, in place: without `do_sample`, `temperature=0` means greedy (`do_sample=False`;
    `temperature`, `top_p`, `top_k` dropped) and `temperature > 0` sampling (`do_sample=True`, `top_p` =
    `default_top_p` when not given and not None). Returns `kwargs`.

    Raises:
        ValueError: a negative `temperature`.
    """
    if "temperature" not in kwargs or "do_sample" in kwargs:
        return kwargs
    temperature = kwargs["temperature"]
    if isinstance(temperature, (int, float)) and temperature < 0:
        raise ValueError(f"`temperature` (={temperature!r}) must be >= 0; pass 0 for greedy decoding or a "
                         "positive temperature to sample.")
    if isinstance(temperature, (int, float)) and temperature == 0:
        for key in ("temperature", "top_p", "top_k"):
            kwargs.pop(key, None)
        kwargs["do_sample"] = False
    else:
        kwargs["do_sample"] = True
        if default_top_p is not None:
            kwargs.setdefault("top_p", default_top_p)
    return kwargs
