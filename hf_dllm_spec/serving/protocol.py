"""Request parsing for the OpenAI-compatible server: the body of `/v1/completions` and `/v1/chat/completions` to
validated decoding options, before a request joins a batch.

The OpenAI request fields are those of the `openai` package's own parameter types (as transformers' `serve` uses
them). Everything else in the body is a decoding option of this library, sent with the `openai` client's
`extra_body`: `decoding_strategy` (default: the server's strategy, else the model's stored one), `top_k`,
`stream_drafts` (also stream provisional drafts, see :mod:`~hf_dllm_spec.serving.app`) and the strategy's
parameters (`block_size`, `confidence_threshold`, ...). They are validated by the library itself
(:func:`hf_dllm_spec.strategies.registry.resolve_config`), so a bad option gets the library's own message as an HTTP 400.

Sampling: `temperature` omitted or 0 decodes greedily (the tokens of `generate` with `do_sample=False`);
`temperature > 0` samples, with `top_p` / `top_k`; `seed` makes a sampled request reproducible.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from ..strategies.registry import get_strategy, resolve_config
from ..validation import invalid


class RequestError(ValueError):
    """A bad request: HTTP `status` (400 by default; 404 for an unknown model) with the library's message."""

    def __init__(self, message: str, status: int = 400, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.param = status, param


def _openai_fields(params_type) -> frozenset[str]:
    return frozenset(params_type.__required_keys__ | params_type.__optional_keys__)


def _known_fields() -> tuple[frozenset[str], frozenset[str]]:
    from openai.types.chat.completion_create_params import CompletionCreateParamsBase as ChatParams
    from openai.types.completion_create_params import CompletionCreateParamsBase as TextParams

    return _openai_fields(TextParams) | {"stream"}, _openai_fields(ChatParams) | {"stream"}


#: OpenAI fields the server reads; every other OpenAI field must be absent or hold its neutral value.
SUPPORTED_FIELDS = frozenset({"model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature",
                              "top_p", "stream", "stream_options", "n", "seed", "user", "stop"})
#: Library options that are not strategy parameters.
EXTRA_OPTIONS = frozenset({"decoding_strategy", "top_k", "stream_drafts"})
_NEUTRAL = (None, False, 0, 1, "", [], {})


@dataclass(frozen=True)
class DecodingOptions:
    """What `generate` needs of one request besides its prompt; requests with equal :attr:`batch_key` can share
    a padded batch.

    Attributes:
        decoding_strategy (`str`): a registered strategy name.
        params (`dict`): its parameters as given (validated), passed to `generate` as keywords.
        do_sample (`bool`): sample (`temperature > 0`) or greedy.
        temperature, top_p, top_k: the sampling warpers (None: the model's generation config).
        seed (`int`, *optional*): seed of the request's own `torch.Generator` (sampling only; a random seed when
            absent): its row draws only from it, so its tokens do not depend on the other rows of its batch.
    """

    decoding_strategy: str
    params: dict = field(default_factory=dict)
    do_sample: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None

    @property
    def batch_key(self) -> str:
        """Equal for requests that one `generate` call can decode together: same strategy, parameters and
        warpers (the seed is not part of it: each row of a sampled batch draws from its own generator)."""
        key = {"s": self.decoding_strategy, "p": self.params, "d": self.do_sample, "t": self.temperature,
               "tp": self.top_p, "tk": self.top_k}
        return json.dumps(key, sort_keys=True, default=str)

    def generate_kwargs(self) -> dict[str, Any]:
        """Keywords for `model.generate` (without the generator and the drafter)."""
        out: dict[str, Any] = {"decoding_strategy": self.decoding_strategy, "do_sample": self.do_sample,
                               **self.params}
        if self.do_sample:
            out.update({k: v for k, v in (("temperature", self.temperature), ("top_p", self.top_p),
                                          ("top_k", self.top_k)) if v is not None})
        return out


@dataclass
class ParsedRequest:
    """A validated request: prompt token ids, budget, decoding options and response options (`stream_drafts`:
    provisional drafts are streamed too; such a request is decoded in a batch of its own, batch 1)."""

    prompt_ids: list[int]
    max_tokens: int
    options: DecodingOptions
    stream: bool = False
    model: str = ""
    stream_drafts: bool = False


def check_fields(body: dict, chat: bool) -> None:
    """Refuse OpenAI fields the server does not implement (set to a non-neutral value)."""
    text_fields, chat_fields = _known_fields()
    for name in sorted((chat_fields if chat else text_fields) - SUPPORTED_FIELDS):
        value = body.get(name)
        if name in body and not any(value is v or (type(value) is type(v) and value == v) for v in _NEUTRAL):
            raise RequestError(str(invalid(name, value, "be left unset: the diffusion server does not implement it",
                                           f"drop `{name}`")), param=name)


def decoding_options(body: dict, *, default_strategy: str, default_params: dict, generation_config,
                     chat: bool) -> DecodingOptions:
    """The request's :class:`DecodingOptions`, validated by the library.

    The server's own parameters (`default_params`, from `serve --param`) apply when the request keeps the
    server's strategy; the request's parameters override them.

    Raises:
        RequestError: unknown strategy or parameter, bad value (the library's message), bad sampling option.
    """
    text_fields, chat_fields = _known_fields()
    known = chat_fields if chat else text_fields
    strategy = body.get("decoding_strategy") or default_strategy
    params = {k: v for k, v in body.items() if k not in known and k not in EXTRA_OPTIONS}
    if strategy == default_strategy:
        params = {**default_params, **params}
    try:
        get_strategy(strategy)
        resolve_config(strategy, generation_config=generation_config, overrides=params)
    except (ValueError, TypeError) as err:
        raise RequestError(str(err)) from err
    temperature, top_p, top_k, seed = (body.get(k) for k in ("temperature", "top_p", "top_k", "seed"))
    for name, value, low in (("temperature", temperature, 0.0), ("top_p", top_p, 0.0)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or value < low):
            raise RequestError(str(invalid(name, value, f"be a number >= {low:g}", f"pass e.g. {name}=0.7")),
                               param=name)
    for name, value in (("top_k", top_k), ("seed", seed)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            raise RequestError(str(invalid(name, value, "be an integer >= 0", f"pass e.g. {name}=0")), param=name)
    do_sample = temperature is not None and temperature > 0
    return DecodingOptions(strategy, params, do_sample, float(temperature) if do_sample else None,
                           top_p if do_sample else None, top_k if do_sample else None, seed)


def max_tokens_of(body: dict, default: int) -> int:
    """`max_tokens` (or chat's `max_completion_tokens`), an integer >= 1; `default` when absent."""
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise RequestError(str(invalid(name, value, "be an integer >= 1", f"pass e.g. {name}=64")), param=name)
    return value


def check_common(body: dict, served_name: str) -> None:
    """`model` must name the served model; `n` must be 1; `stop` is not implemented.

    Raises:
        RequestError: 404 for another model, 400 otherwise.
    """
    model = body.get("model")
    if model is not None and model != served_name:
        raise RequestError(str(invalid("model", model, f"be the served model {served_name!r}",
                                       f"pass model={served_name!r} (see /v1/models)")), status=404, param="model")
    n = body.get("n")
    if n is not None and n != 1:
        raise RequestError(str(invalid("n", n, "be 1: one completion per request",
                                       "send n separate requests (they are batched together)")), param="n")
    if body.get("stop"):
        raise RequestError(str(invalid("stop", body["stop"], "be left unset: stop sequences are not implemented "
                                       "by the server yet", "drop `stop`; the model's eos ids end a completion")),
                           param="stop")


def completion_prompt(body: dict, tokenizer) -> list[int]:
    """The prompt of `/v1/completions` as token ids: a string, or a list of token ids (one prompt only)."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str) and prompt:
        return tokenizer(prompt)["input_ids"]
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return list(prompt)
    raise RequestError(str(invalid("prompt", prompt, "be a non-empty string or list of token ids (one prompt)",
                                   "send one prompt per request (they are batched together)")), param="prompt")


#: The chat template set at serve time on a tokenizer that has none (the bundled models): the prompt format they
#: were trained on (`recipes.arithmetic.format_prompt`), a user turn as "Question: ..." and an assistant turn as
#: "Answer: ..." on their own lines (other roles as their bare content), then "Answer:" to prompt the reply.
MINIMAL_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'user' %}Question: {% elif message['role'] == 'assistant' %}Answer: {% endif %}"
    "{{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}Answer:{% endif %}"
)


def ensure_chat_template(tokenizer) -> bool:
    """Give `tokenizer` :data:`MINIMAL_CHAT_TEMPLATE` if it has no chat template (in memory only; a checkpoint's
    own template is kept). Returns whether it was set."""
    if getattr(tokenizer, "chat_template", None):
        return False
    tokenizer.chat_template = MINIMAL_CHAT_TEMPLATE
    return True


def chat_prompt(body: dict, tokenizer) -> list[int]:
    """The messages of `/v1/chat/completions` through the tokenizer's chat template, as token ids (text content
    parts are joined with spaces, as transformers' `serve` does for text models)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) and "role" in m
                                                                 for m in messages):
        raise RequestError(str(invalid("messages", messages, "be a non-empty list of {'role', 'content'} messages",
                                       "pass messages=[{'role': 'user', 'content': '...'}]")), param="messages")
    flat = []
    for m in messages:
        content = m.get("content") or ""
        if isinstance(content, list):
            content = " ".join(part.get("text", "") for part in content if isinstance(part, dict))
        flat.append({"role": m["role"], "content": content})
    text = tokenizer.apply_chat_template(flat, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def parse_request(body: Any, *, chat: bool, tokenizer, served_name: str, default_strategy: str,
                  default_params: dict, generation_config, default_max_tokens: int) -> ParsedRequest:
    """The whole validation of one request body (before it joins a batch).

    Raises:
        RequestError: with the status and message of the first problem.
    """
    if not isinstance(body, dict):
        raise RequestError(str(invalid("body", type(body).__name__, "be a JSON object", "send a JSON object")))
    check_common(body, served_name)
    check_fields(body, chat)
    stream, drafts = body.get("stream") or False, body.get("stream_drafts") or False
    for name, value in (("stream", stream), ("stream_drafts", drafts)):
        if not isinstance(value, bool):
            raise RequestError(str(invalid(name, value, "be a bool", f"pass {name}=True or False")), param=name)
    if drafts and not stream:
        raise RequestError(str(invalid("stream_drafts", drafts, "come with stream=True (drafts are streamed)",
                                       "pass stream=True, or drop stream_drafts")), param="stream_drafts")
    options = decoding_options(body, default_strategy=default_strategy, default_params=default_params,
                               generation_config=generation_config, chat=chat)
    max_tokens = max_tokens_of(body, default_max_tokens)
    prompt_ids = chat_prompt(body, tokenizer) if chat else completion_prompt(body, tokenizer)
    return ParsedRequest(prompt_ids, max_tokens, options, stream, served_name, drafts)
