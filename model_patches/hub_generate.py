"""What the families' Hub code does differently at the edges: its `generate` keywords, a mask token kept only in
the tokenizer files, and the read-only cache keyword of its forward. Shared by the families whose Hub code this
library replaces (SDAR, Fast-dLLM v2, LLaDA2).
"""

from __future__ import annotations

import functools
import inspect
import json
import os
from typing import Any, Callable, ClassVar

from .compat import crop, find_cache

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


def read_only_cache_keyword(keyword: str, family: str) -> Callable[[Callable], Callable]:
    """Decorate a causal LM's `forward` to honour its Hub modeling's cache keyword (families.md: SDAR's and the S2D2
    LLaDA2 port's `store_kv`, Fast-dLLM v2's `update_past_key_values`): `False` leaves a given cache as it was (the
    positions the forward appended are cropped: read-only), `True` or unset writes it as any transformers model does.
    Without it the keyword went down to the attention unread and the cache grew on every forward of code ported
    from the Hub; the library's own runner never passes it.

    Args:
        keyword (`str`): the forward's keyword. family (`str`): the family named in the error.

    Raises:
        ValueError: (at call time) for a value that is not True, False or None, naming `keyword`.
    """

    def decorate(forward: Callable) -> Callable:
        signature = inspect.signature(forward)
        variadic = [p.name for p in signature.parameters.values() if p.kind is inspect.Parameter.VAR_KEYWORD]

        @functools.wraps(forward)
        def wrapper(self, *args, **kwargs):
            store = kwargs.pop(keyword, None)
            if store is not None and not isinstance(store, bool):
                raise ValueError(f"`{keyword}` (={store!r}) must be True, False or unset (the Hub {family} modeling's "
                                 f"cache protocol); pass {keyword}=False for a read-only forward.")
            if store is False and args:              # the cache passed by position: every argument by name
                named = dict(signature.bind_partial(self, *args, **kwargs).arguments)
                named.pop("self")
                extra = named.pop(variadic[0], {}) if variadic else {}
                args, kwargs = (), {**named, **extra}
            cache = find_cache(kwargs) if store is False else None
            length = cache.get_seq_length() if cache is not None else 0
            out = forward(self, *args, **kwargs)
            if cache is not None and cache.get_seq_length() > length:
                crop(cache, cache.get_seq_length() - length)
            return out

        return wrapper

    return decorate
