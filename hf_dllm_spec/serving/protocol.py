"""Request parsing for the OpenAI-compatible server: the body of `/v1/completions` and `/v1/chat/completions` to
validated decoding options, before a request joins a batch.

The OpenAI request fields are those of the `openai` package's own parameter types (as transformers' `serve` uses
them). Everything else in the body is a decoding option of this library, sent with the `openai` client's
`extra_body`: `decoding_strategy` (default: the server's strategy, else the model's stored one), `top_k`,
`stream_drafts` (also stream provisional drafts, see :mod:`~hf_dllm_spec.serving.app`) and the strategy's
parameters (`block_size`, `confidence_threshold`, ...). They are validated by the library itself
(:func:`hf_dllm_spec.strategies.registry.resolve_config`), so a bad option gets the library's own message as an HTTP 400.

Sampling: `temperature` omitted, 0 or below 1e-5 (vLLM's rule: float32 logits divided by less can overflow) decodes
greedily (the tokens of `generate` with `do_sample=False`); a larger one samples, with `top_p` / `top_k`; `seed`
makes a sampled request reproducible. A `temperature` beyond float32's range (3.4e38) gets a 400.

Choices: `n` completions per prompt and, on `/v1/completions`, a list of prompts (strings or token id lists), at
most :data:`MAX_CHOICES` completions in all; each completion is a row of its own in the batcher (they are batched
together), completion j of a seeded request samples with `seed + j` (:func:`parse_request`).

vLLM's extensions: `ignore_eos=true` decodes to the budget (`generate(eos_token_id=None)`); `min_tokens` (vLLM:
no stop token before that many tokens) is accepted when it is 0 or the request ignores eos: no strategy of the
library can hold a stop token back until a position (they commit tokens out of order; transformers'
`min_new_tokens` is refused by `hf_dllm_spec.maths.sampling`), so any other `min_tokens` gets a 400.
`logprobs` / `top_logprobs` are not implemented (per-token scores are not defined for out-of-order commits):
any value but null / false gets a 400.

Every refusal is a :class:`RequestError` whose message names the field, its value (a short excerpt of a big one),
the rule and the fix in the server's terms (`max_tokens`, the `--draft-model` flag; :func:`server_terms`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from typing import Any

from ..strategies.registry import get_strategy, resolve_config, strategy_parameter_names
from ..validation import check_range, invalid


class RequestError(ValueError):
    """A bad request: HTTP `status` (400 by default; 404 for an unknown model, 401, 413, 415, 429, ...) with the
    library's message, the field it is about (`param`) and extra response `headers` (`Retry-After`, ...)."""

    def __init__(self, message: str, status: int = 400, param: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.param, self.headers = status, param, headers


#: Python spellings in the library's messages -> the server's (request fields, `serve` flags).
_SERVER_TERMS = (
    ("pass draft_model=<a smaller model of the same tokenizer>",
     "start the server with `--draft-model PATH` (a smaller model of the same tokenizer)"),
    ("the diffusion model as draft_model=", "the diffusion model as `--draft-model` (hf-dllm-spec serve AR_MODEL "
                                            "--draft-model DIFFUSION_MODEL)"),
    ("max_new_tokens", "max_tokens"),
)


def server_terms(message: str, prompt_field: str = "prompt") -> str:
    """A library message with its Python fixes said in the server's terms (`max_new_tokens` -> `max_tokens`,
    `draft_model=` -> the `--draft-model` flag, `input_ids` -> `prompt_field`: `prompt` or chat's `messages`)."""
    for python, server in (*_SERVER_TERMS, ("`input_ids`", f"`{prompt_field}`")):
        message = message.replace(python, server)
    return message


def request_field(where: str) -> str:
    """The request field a place in the body is in: `prompt[2]` (an item of a list of prompts) is in `prompt`."""
    return where.split("[", 1)[0]


def server_error(err: Exception, prompt_field: str = "prompt", body_fields=()) -> RequestError:
    """A library refusal (`ValueError` / `NotImplementedError`, built by :func:`hf_dllm_spec.validation.invalid`)
    as a 400 in the server's terms (:func:`server_terms`) whose `param` is the request field it names: a strategy
    parameter, an option or one of `body_fields` (the request's own) as itself, `input_ids` as `prompt_field`,
    `max_new_tokens` as `max_tokens`; None for a name a request cannot hold (the model's special ids)."""
    name = getattr(err, "param", None)
    name = {"input_ids": prompt_field, "max_new_tokens": "max_tokens"}.get(name, name)
    name = request_field(name) if isinstance(name, str) else name
    fields = SUPPORTED_FIELDS | EXTRA_OPTIONS | {*body_fields, *strategy_parameter_names()}
    return RequestError(server_terms(str(err), prompt_field), param=name if name in fields else None)


def excerpt(value: Any, limit: int = 60) -> Any:
    """`value` itself when its repr is short, else a string describing it (`'<str of 10485760 characters:
    'aaaa...>'`), for an error message that must not echo a big input."""
    text = repr(value)
    if len(text) <= limit:
        return value
    size = f"{len(value)} {'characters' if isinstance(value, str) else 'items'}" if hasattr(value, "__len__") else ""
    return f"<{type(value).__name__} of {size}: {text[:limit // 2]}...>" if size else f"<{text[:limit]}...>"


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
EXTRA_OPTIONS = frozenset({"decoding_strategy", "top_k", "stream_drafts", "ignore_eos", "min_tokens"})
#: Neutral values of any unimplemented field (besides null), compared with their type.
_NEUTRAL = (False, "", [], {})
#: Numeric fields and their one neutral number (0 and 0.0 alike; never a bool).
_NUMERIC_NEUTRAL = {"frequency_penalty": 0, "presence_penalty": 0, "best_of": 1, "top_logprobs": 0}
#: Further neutral values of some fields (what they do by default).
_MORE_NEUTRAL = {"response_format": ({"type": "text"},), "tool_choice": ("none",), "parallel_tool_calls": (True,),
                 "modalities": (["text"],)}
#: Fields with fewer neutral values than null and :data:`_NEUTRAL`: `logprobs` only null and false (`logprobs=0`
#: asks for the chosen token's logprob); fields whose mere presence asks for something (`web_search_options={}`
#: turns search on) only null.
_FEW_NEUTRAL = {"logprobs": (False,), "web_search_options": (), "audio": (), "prediction": ()}
#: The fix for a field of the other endpoint.
_OTHER_ENDPOINT_FIX = {"max_completion_tokens": "pass `max_tokens`", "prompt": "send the prompt as `messages`",
                       "messages": "send `prompt`, or the messages to /v1/chat/completions"}
#: Below this `temperature` a request decodes greedily (vLLM's rule): dividing float32 logits by a smaller one can
#: overflow (inf / NaN probabilities).
GREEDY_TEMPERATURE = 1e-5
#: The largest `temperature` (float32's largest finite value): a larger one is infinite in float32, and a masked
#: logit (-inf) divided by it is NaN.
MAX_TEMPERATURE = 3.4e38
#: Largest seed a request's `torch.Generator` takes (`manual_seed` accepts unsigned 64-bit values).
MAX_SEED = 2 ** 64 - 1
#: Most completions one request asks for (`n` times its prompts), as OpenAI's largest `n`.
MAX_CHOICES = 128


@dataclass(frozen=True)
class DecodingOptions:
    """What `generate` needs of one request besides its prompt; requests with equal :attr:`batch_key` can share
    a padded batch.

    Attributes:
        decoding_strategy (`str`): a registered strategy name.
        params (`dict`): its parameters as given (validated), passed to `generate` as keywords.
        do_sample (`bool`): sample (`temperature >= GREEDY_TEMPERATURE`, 1e-5) or greedy.
        temperature, top_p, top_k: the sampling warpers (None: the model's generation config).
        seed (`int`, *optional*): seed of the request's own `torch.Generator` (sampling only; a random seed when
            absent): its row draws only from it, so its tokens do not depend on the other rows of its batch.
        ignore_eos (`bool`): decode to the budget: the row's own stop rule in a continuous batch of a strategy
            with `per_row_stops`, else `generate(eos_token_id=None)` for its whole batch.
    """

    decoding_strategy: str
    params: dict = field(default_factory=dict)
    do_sample: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    ignore_eos: bool = False

    @property
    def batch_key(self) -> str:
        """Equal for requests that one `generate` call can decode together: same strategy, parameters and
        sampling mode (the seed is not part of it: each row of a sampled batch draws from its own generator; nor are
        the warpers where each row samples with its own, the strategy's `per_row_sampling`, nor `ignore_eos` where
        each row ends by its own stop rule, its `per_row_stops`)."""
        strategy = get_strategy(self.decoding_strategy)
        warpers = None if strategy.per_row_sampling else (self.temperature, self.top_p, self.top_k)
        key = {"s": self.decoding_strategy, "p": self.params, "d": self.do_sample, "w": warpers,
               "ie": None if strategy.per_row_stops else self.ignore_eos}
        return json.dumps(key, sort_keys=True, default=str)

    @property
    def per_row_stops(self) -> bool:
        """Whether the strategy lets rows of one call end by different stop rules (`ignore_eos` per row)."""
        return get_strategy(self.decoding_strategy).per_row_stops

    def generate_kwargs(self, per_row: bool = False) -> dict[str, Any]:
        """Keywords for `model.generate` (without the warpers, the generator and the drafter: the batcher resolves
        them against the model, `Batcher._sampling`); `per_row`: `ignore_eos` is left to the row's own stop rule (a
        continuous batch of a strategy with :attr:`per_row_stops`)."""
        out: dict[str, Any] = {"decoding_strategy": self.decoding_strategy, "do_sample": self.do_sample,
                               **self.params}
        if self.ignore_eos and not (per_row and self.per_row_stops):
            out["eos_token_id"] = None
        return out


@dataclass
class ParsedRequest:
    """One completion of a validated request (a row of a batch; a request asks for `n` per prompt): prompt token
    ids, budget, decoding options and response options (`stream_drafts`: provisional drafts are streamed too; such a
    request is decoded in a batch of its own, batch 1); `prompt_field`: where its prompt was (`prompt`, the item
    `prompt[i]` of a list of several, or chat's `messages`), named by its errors; `sample`: which of its prompt's
    `n` completions it is (0 for the first)."""

    prompt_ids: list[int]
    max_tokens: int
    options: DecodingOptions
    stream: bool = False
    model: str = ""
    stream_drafts: bool = False
    prompt_field: str = "prompt"
    sample: int = 0


def check_fields(body: dict, chat: bool) -> None:
    """Refuse OpenAI fields the server does not implement (set to a non-neutral value), fields of the other
    endpoint (`max_completion_tokens` on `/v1/completions`, `prompt` on `/v1/chat/completions`), and a
    `stream_options` that is not an object with a bool `include_usage`, or comes without `stream=true` (as OpenAI).

    Raises:
        RequestError: 400 naming the field.
    """
    text_fields, chat_fields = _known_fields()
    own, other = (chat_fields, text_fields) if chat else (text_fields, chat_fields)
    path = "/v1/chat/completions" if chat else "/v1/completions"
    for name in sorted(name for name in (other - own) & body.keys() if body[name] is not None):
        fix = _OTHER_ENDPOINT_FIX.get(name, f"drop `{name}`, or send the request to the endpoint that takes it")
        raise RequestError(str(invalid(name, excerpt(body[name]), f"be left out: {path} has no such field", fix)),
                           param=name)
    _check_stream_options(body)
    for name in sorted(own - SUPPORTED_FIELDS):
        value = body.get(name)
        if name in body and not _neutral(name, value):
            why = ("per-token log-probabilities are not defined when a diffusion decoder commits tokens out of "
                   "order" if "logprobs" in name else "the diffusion server does not implement it")
            raise RequestError(str(invalid(name, excerpt(value), f"be left unset: {why}", f"drop `{name}`")),
                               param=name)


def _check_stream_options(body: dict) -> None:
    options = body.get("stream_options")
    if options is None:
        return
    if not isinstance(options, dict) or set(options) - {"include_usage", "include_obfuscation"} \
            or not all(isinstance(value, bool) for value in options.values()):
        raise RequestError(str(invalid("stream_options", excerpt(options), "be an object with a bool `include_usage` "
                                       "(and `include_obfuscation`)",
                                       "pass stream_options={'include_usage': true}")), param="stream_options")
    if body.get("stream") is not True:
        raise RequestError(str(invalid("stream_options", excerpt(options), "come with stream=true",
                                       "pass stream=true, or drop `stream_options`")), param="stream_options")


def _neutral(name: str, value: Any) -> bool:
    """Whether an unimplemented OpenAI field's `value` asks for nothing: null; the field's neutral number
    (:data:`_NUMERIC_NEUTRAL`, int or float); false for `logprobs`, nothing more for a field whose presence asks
    for something (:data:`_FEW_NEUTRAL`); else false, "", [], {} or the field's default (:data:`_MORE_NEUTRAL`), of
    the same type."""
    if value is None:
        return True
    if name in _NUMERIC_NEUTRAL:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and value == _NUMERIC_NEUTRAL[name]
    if name in _FEW_NEUTRAL:
        return any(value is v for v in _FEW_NEUTRAL[name])
    return any(type(value) is type(v) and value == v for v in (*_NEUTRAL, *_MORE_NEUTRAL.get(name, ())))


def _check_number(name: str, value: Any, **bounds) -> None:
    """`hf_dllm_spec.validation.check_range` as a :class:`RequestError` naming the field."""
    try:
        check_range(name, value, fix=f"pass e.g. {name}={_EXAMPLES[name]}", **bounds)
    except ValueError as err:
        raise RequestError(str(err), param=name) from None


def _check_int(name: str, value: Any, low: int, high: int, fix: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise RequestError(str(invalid(name, excerpt(value), f"be an integer in [{low}, {high}]", fix)), param=name)


_EXAMPLES = {"temperature": 0.7, "top_p": 0.9}


def decoding_options(body: dict, *, default_strategy: str, default_params: dict, generation_config,
                     chat: bool, has_drafter: bool = True) -> DecodingOptions:
    """The request's :class:`DecodingOptions`, validated by the library.

    The server's own parameters (`default_params`, from `serve --param`) apply when the request keeps the
    server's strategy; the request's parameters override them. `temperature` must be a finite number >= 0,
    `top_p` in (0, 1], `top_k` and `seed` integers >= 0 (`seed` < 2**64); a strategy that drafts with a separate
    model needs a server started with one (`has_drafter`).

    Raises:
        RequestError: unknown strategy or parameter, bad value (the library's message), bad sampling option.
    """
    text_fields, chat_fields = _known_fields()
    known = text_fields | chat_fields               # the other endpoint's: null here (`check_fields` refused others)
    strategy = body.get("decoding_strategy") or default_strategy
    params = {k: v for k, v in body.items() if k not in known and k not in EXTRA_OPTIONS}
    if strategy == default_strategy:
        params = {**default_params, **params}
    if not isinstance(strategy, str):
        raise RequestError(str(invalid("decoding_strategy", excerpt(strategy), "be a strategy name",
                                       "pass e.g. decoding_strategy='s2d2'")), param="decoding_strategy")
    try:
        strategy_class = get_strategy(strategy)
        resolve_config(strategy, generation_config=generation_config, overrides=params)
    except (ValueError, TypeError) as err:
        raise server_error(err, "messages" if chat else "prompt", body) from err
    if strategy_class.uses_drafter and not has_drafter:
        raise RequestError(str(invalid("decoding_strategy", strategy, "run on a server started with a drafter: it "
                                       "drafts with a separate model (`draft_model`)", "restart the server with "
                                       "`hf-dllm-spec serve MODEL --draft-model PATH`, or pick a decoding_strategy "
                                       "that drafts with the target itself")), param="decoding_strategy")
    temperature, top_p, top_k, seed = (body.get(k) for k in ("temperature", "top_p", "top_k", "seed"))
    if temperature is not None:
        _check_number("temperature", temperature, low=0.0, high=MAX_TEMPERATURE)
    if top_p is not None:
        _check_number("top_p", top_p, low=0.0, low_open=True, high=1.0)
    if top_k is not None:
        _check_int("top_k", top_k, 0, 2 ** 63 - 1, "pass e.g. top_k=50 (0: no top-k)")
    if seed is not None:
        _check_int("seed", seed, 0, MAX_SEED, "pass a seed in that range, e.g. seed=1234")
    ignore_eos = body.get("ignore_eos")
    if ignore_eos is not None and not isinstance(ignore_eos, bool):
        raise RequestError(str(invalid("ignore_eos", excerpt(ignore_eos), "be a bool", "pass true or false")),
                           param="ignore_eos")
    do_sample = temperature is not None and temperature >= GREEDY_TEMPERATURE
    return DecodingOptions(strategy, params, do_sample, float(temperature) if do_sample else None,
                           top_p if do_sample else None, top_k if do_sample else None, seed, bool(ignore_eos))


def max_tokens_of(body: dict, default: int) -> int:
    """Chat's `max_completion_tokens`, else `max_tokens`, else `default`; each one given must be an integer >= 1."""
    budget = default
    for name in ("max_tokens", "max_completion_tokens"):
        value = body.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise RequestError(str(invalid(name, excerpt(value), "be an integer >= 1", f"pass e.g. {name}=64")),
                               param=name)
        budget = value
    return budget


def check_min_tokens(body: dict, max_tokens: int, ignore_eos: bool) -> None:
    """vLLM's `min_tokens`: an integer in [0, max_tokens]; above 0 only with `ignore_eos=true` (the module
    docstring says why).

    Raises:
        RequestError: 400 naming `min_tokens`.
    """
    value = body.get("min_tokens")
    if value is None:
        return
    _check_int("min_tokens", value, 0, max_tokens, f"pass an integer up to max_tokens ({max_tokens})")
    if value > 0 and not ignore_eos:
        raise RequestError(str(invalid(
            "min_tokens", value, "be 0 unless ignore_eos=true: the diffusion strategies commit tokens out of order, "
            "so none can hold a stop token back until a position (transformers' min_new_tokens is refused)",
            "drop `min_tokens`, or pass ignore_eos=true (every request then decodes max_tokens tokens)")),
            param="min_tokens")


def check_common(body: dict, served_name: str) -> None:
    """`model` must name the served model; `n` must be an integer in [1, :data:`MAX_CHOICES`]; `stop` is not
    implemented.

    Raises:
        RequestError: 404 for another model, 400 otherwise.
    """
    model = body.get("model")
    if model is not None and model != served_name:
        raise RequestError(str(invalid("model", excerpt(model), f"be the served model {served_name!r}",
                                       f"pass model={served_name!r} (see /v1/models)")), status=404, param="model")
    n = body.get("n")
    if n is not None:
        _check_int("n", n, 1, MAX_CHOICES, f"pass at most {MAX_CHOICES} completions per request, e.g. n=2")
    if body.get("stop"):
        raise RequestError(str(invalid("stop", excerpt(body["stop"]), "be left unset: stop sequences are not implemented "
                                       "by the server yet", "drop `stop`; the model's eos ids end a completion")),
                           param="stop")


def prompt_list(body: dict) -> bool:
    """Whether a `/v1/completions` body holds a list of prompts: a list whose first item is a string or a list (as
    LangChain's `OpenAI.batch` sends them); else one prompt (a string or a list of token ids). Its items are then
    named `prompt[i]`, also when there is only one."""
    prompt = body.get("prompt")
    return isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], (str, list))


def completion_prompts(body: dict, tokenizer, vocab_size: int | None = None) -> list[list[int]]:
    """The prompts of `/v1/completions` as token ids, as OpenAI takes them: a string, a list of token ids, or a list
    of several prompts (strings or lists of token ids, :func:`prompt_list`), each token id in [0, vocab_size).

    Returns:
        `list[list[int]]`: the prompts in order (one for a string or a list of ids).

    Raises:
        RequestError: 400 naming `prompt` (or the element at fault, `prompt[i]`, `prompt[i][j]`).
    """
    prompt = body.get("prompt")
    if not prompt_list(body):
        return [_one_prompt(prompt, "prompt", tokenizer, vocab_size)]
    return [_one_prompt(item, f"prompt[{i}]", tokenizer, vocab_size) for i, item in enumerate(prompt)]


def _one_prompt(prompt: Any, where: str, tokenizer, vocab_size: int | None) -> list[int]:
    """One prompt of `/v1/completions` (a non-empty string or list of token ids) as token ids."""
    if isinstance(prompt, str) and prompt:
        return tokenizer(prompt)["input_ids"]
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        bad = next((k for k, t in enumerate(prompt) if t < 0 or (vocab_size is not None and t >= vocab_size)), None)
        if bad is not None:
            raise RequestError(str(invalid(f"{where}[{bad}]", excerpt(prompt[bad]), f"be a token id in [0, "
                                           f"{vocab_size}) (the model's vocabulary)", "send ids of the served "
                                           "model's tokenizer, or the prompt as text")), param="prompt")
        return list(prompt)
    raise RequestError(str(invalid(where, excerpt(prompt), "be a non-empty string or list of token ids (or, for "
                                   "`prompt`, a list of such prompts)", "send the prompt as text")), param="prompt")


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


#: Content part types read as text: chat completions' "text", the Responses API's "input_text" / "output_text"
#: (as transformers' `serve` reads them); an assistant's "refusal" part is read as its `refusal` text.
TEXT_PARTS = ("text", "input_text", "output_text")


def chat_prompt(body: dict, tokenizer) -> list[int]:
    """The messages of `/v1/chat/completions` through the tokenizer's chat template, as token ids.

    As transformers' `serve` passes them to a text model's template (text content parts joined with spaces,
    `tool_calls` with their `arguments` parsed from JSON, `tool_call_id`), and two things it drops: the content of
    an assistant message that also calls tools (the API allows both, and templates such as Qwen2.5's render both)
    and `name` (for the templates that read it). Only an assistant message may leave `content` out (null); a part
    of another type (an image, audio) is refused: the model reads text only.

    Raises:
        RequestError: 400 naming the message (`messages[i].content[j]`), or the template's own refusal (a role
            it does not take, turns that do not alternate).
    """
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) and "role" in m
                                                                 for m in messages):
        raise _bad_messages("messages", messages, "be a non-empty list of {'role', 'content'} messages",
                            "pass messages=[{'role': 'user', 'content': '...'}]")
    flat = [_template_message(m, f"messages[{i}]") for i, m in enumerate(messages)]
    from jinja2 import TemplateError

    try:
        text = tokenizer.apply_chat_template(flat, tokenize=False, add_generation_prompt=True)
    except (TemplateError, TypeError, ValueError, KeyError) as err:
        raise _bad_messages("messages", messages, f"be accepted by the model's chat template, which refused them: "
                            f"{type(err).__name__}: {excerpt(str(err), 200)}",
                            "send roles and turns the model's template takes") from None
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _bad_messages(where: str, value: Any, rule: str, fix: str) -> RequestError:
    """A 400 about the chat messages: the message names the place (`messages[0].content[1]`), `param` is
    `messages`."""
    return RequestError(str(invalid(where, excerpt(value), rule, fix)), param="messages")


def _template_message(message: dict, where: str) -> dict:
    """One OpenAI message as the chat template takes it (see :func:`chat_prompt`)."""
    role, content = message["role"], message.get("content")
    if not isinstance(role, str):
        raise _bad_messages(f"{where}.role", role, "be a string", "pass 'system', 'user', 'assistant' or 'tool'")
    if content is None and role == "assistant":
        content = ""
    elif isinstance(content, list):
        content = " ".join(_part_text(part, f"{where}.content[{j}]") for j, part in enumerate(content))
    if not isinstance(content, str):
        raise _bad_messages(f"{where}.content", content, "be a string or a list of text parts (null only in an "
                            "assistant message)", "pass {'role': 'user', 'content': '...'}")
    out = {"role": role, "content": content}
    for key in ("tool_call_id", "name"):
        if message.get(key) is not None:
            if not isinstance(message[key], str):
                raise _bad_messages(f"{where}.{key}", message[key], "be a string", f"pass the {key} as a string")
            out[key] = message[key]
    calls = message.get("tool_calls")
    if calls:
        if not isinstance(calls, list):
            raise _bad_messages(f"{where}.tool_calls", calls, "be a list", "pass a list of tool calls")
        out["tool_calls"] = [_tool_call(call, f"{where}.tool_calls[{j}]") for j, call in enumerate(calls)]
    return out


def _part_text(part: Any, where: str) -> str:
    if isinstance(part, dict) and part.get("type") in TEXT_PARTS and isinstance(part.get("text"), str):
        return part["text"]
    if isinstance(part, dict) and part.get("type") == "refusal" and isinstance(part.get("refusal"), str):
        return part["refusal"]                                   # an assistant's earlier refusal, in its words
    kind = part.get("type") if isinstance(part, dict) else type(part).__name__
    raise _bad_messages(where, part, "be a text part {'type': 'text', 'text': '...'}: the served model reads text "
                        f"only (got {kind!r})", "send the content as text")


def _tool_call(call: Any, where: str) -> dict:
    """A tool call with its `function.arguments` parsed when they are JSON (as the OpenAI API sends them: chat
    templates iterate an object, or `tojson` it); other text is passed on as it is (the API allows any string)."""
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise _bad_messages(where, call, "be {'function': {'name': '...', 'arguments': '...'}}",
                            "send the tool call as the API returned it")
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            pass
    return {**call, "function": {**function, "arguments": arguments}}


def parse_request(body: Any, *, chat: bool, tokenizer, served_name: str, default_strategy: str,
                  default_params: dict, generation_config, default_max_tokens: int, vocab_size: int | None = None,
                  max_prompt_tokens: int | None = None, has_drafter: bool = True) -> list[ParsedRequest]:
    """The whole validation of one request body (before it joins a batch): the fields, the decoding options,
    the budget, then the prompts (token ids in [0, `vocab_size`), at most `max_prompt_tokens` of them each).

    Returns:
        `list[ParsedRequest]`: the request's completions in OpenAI's order of `choices` (prompt by prompt, `n` each:
        choice `i * n + j` is completion j of prompt i). Completion j of a sampled request with a `seed` samples
        with seed `seed + j` (modulo 2**64), so completion 0 has the tokens of the same request with `n=1`, and each
        prompt of a list the tokens it gets alone.

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
                               generation_config=generation_config, chat=chat, has_drafter=has_drafter)
    max_tokens = max_tokens_of(body, default_max_tokens)
    check_min_tokens(body, max_tokens, options.ignore_eos)
    n, listed = body.get("n") or 1, not chat and prompt_list(body)
    _check_choices(len(body["prompt"]) if listed else 1, n, drafts)     # counted before any is tokenized
    prompts = [chat_prompt(body, tokenizer)] if chat else completion_prompts(body, tokenizer, vocab_size)
    field = "messages" if chat else "prompt"
    wheres = [f"{field}[{i}]" for i in range(len(prompts))] if listed else [field]
    for where, prompt_ids in zip(wheres, prompts):
        if max_prompt_tokens is not None and len(prompt_ids) > max_prompt_tokens:
            raise RequestError(str(invalid(where, f"<prompt of {len(prompt_ids)} tokens>",
                                           f"be at most {max_prompt_tokens} tokens (the server's --max-prompt-tokens)",
                                           "send a shorter prompt")), param=field)
    return [ParsedRequest(prompt_ids, max_tokens, _sample_options(options, j), stream, served_name, drafts, where, j)
            for where, prompt_ids in zip(wheres, prompts) for j in range(n)]


def _check_choices(prompts: int, n: int, drafts: bool) -> None:
    """At most :data:`MAX_CHOICES` completions in all; `stream_drafts` with one only (its stream is batch 1)."""
    if prompts * n > MAX_CHOICES:
        raise RequestError(str(invalid("prompt", f"<{prompts} prompts>", f"ask for at most {MAX_CHOICES} completions "
                                       f"with n={n} ({prompts * n} asked)", "split the prompts over several "
                                       "requests (they are batched together)")), param="prompt")
    if drafts and prompts * n > 1:
        raise RequestError(str(invalid("stream_drafts", drafts, f"ask for one completion ({prompts * n} asked: "
                                       "drafts are streamed for a batch of one)", "pass n=1 and one prompt, or drop "
                                       "stream_drafts")), param="stream_drafts")


def _sample_options(options: DecodingOptions, j: int) -> DecodingOptions:
    """The options of completion `j` of a prompt: its seed moved by `j` (a sampled request with a seed)."""
    if j == 0 or options.seed is None:
        return options
    return replace(options, seed=(options.seed + j) % (MAX_SEED + 1))
