"""What the server refuses before a request body is parsed: the API key, the body's size, type and arrival time,
JSON nesting, huge integers and non-finite numbers; and the short excerpts error answers quote.

Order of the checks on a request (each answer is `{"error": {"message", "type", "param", "code"}}`):

1. `Host` not in `allowed_hosts` -> 400 (:class:`HostCheckMiddleware`; DNS rebinding of a loopback server).
2. No `Authorization: Bearer <api_key>` (when a key is set; every route but `/health`) -> 401, compared in
   constant time (`secrets.compare_digest`).
3. `Content-Type` other than `application/json` on a POST -> 415 (a browser's cross-origin "simple" POST is
   `text/plain`: never executed).
4. A body over `max_body_bytes` -> 413, from its `Content-Length` before a byte is read, else as soon as the bytes
   received pass the limit (chunked bodies); a body that has not fully arrived `body_timeout_s` seconds after
   the handler starts reading it -> 408 (a slow client holds no decoding slot: it is not queued before its body
   is complete).
5. Not RFC 8259 JSON (`NaN`, `Infinity`, bad syntax), nested deeper than `max_json_depth`, an integer outside
   int64 (except the request's `seed`, an unsigned 64-bit value) or a non-finite float (`1e400`) -> 400 naming
   the JSON path.

Header-level slow clients are uvicorn's: `timeout_keep_alive` closes idle connections; uvicorn has no timeout for
a request's headers (run behind a reverse proxy for that).
"""

from __future__ import annotations

import asyncio
import math
import secrets
from dataclasses import dataclass
from typing import Any

from ..validation import invalid
from .protocol import RequestError, excerpt

#: The environment variable `serve` reads the API key from when `--api-key` is not given.
API_KEY_ENV = "HF_DLLM_SPEC_API_KEY"
INT64_MIN, INT64_MAX, UINT64_MAX = -(2 ** 63), 2 ** 63 - 1, 2 ** 64 - 1
#: Longest error message returned (longer ones keep their head and tail: the field and the fix).
MAX_MESSAGE_CHARS = 1000


@dataclass(frozen=True)
class ServerLimits:
    """The server's limits (`hf-dllm-spec serve` options of the same names).

    Attributes:
        api_key (`str`, *optional*): the bearer token every route but `/health` requires (None: no key).
        max_body_bytes (`int`, defaults to 4 MiB): largest request body, in bytes.
        max_json_depth (`int`, defaults to 32): deepest nesting of JSON arrays and objects in a body.
        max_prompt_tokens (`int`, defaults to 32768): longest prompt, in tokens (after the chat template); the
            model's own context length is checked by the library after this.
        body_timeout_s (`float`, defaults to 30): seconds a client has to send its whole body once the server
            starts reading it.
        allowed_hosts (`tuple[str, ...]`, defaults to any): `Host` header values accepted (`"*"`: any;
            `"*.example.com"` wildcards as in Starlette).
        max_waiting (`int`, *optional*): most requests waiting for a batch; past it a request gets 429 with
            `Retry-After` (None: no limit).
    """

    api_key: str | None = None
    max_body_bytes: int = 4 * 2 ** 20
    max_json_depth: int = 32
    max_prompt_tokens: int = 32768
    body_timeout_s: float = 30.0
    allowed_hosts: tuple[str, ...] = ("*",)
    max_waiting: int | None = None

    def __post_init__(self) -> None:
        for name in ("max_body_bytes", "max_json_depth", "max_prompt_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise invalid(name, value, "be an integer >= 1", f"pass e.g. {name}=1024")
        if self.max_waiting is not None and (not isinstance(self.max_waiting, int) or self.max_waiting < 0):
            raise invalid("max_waiting", self.max_waiting, "be an integer >= 0 or None", "pass e.g. max_waiting=64")
        if not (isinstance(self.body_timeout_s, (int, float)) and self.body_timeout_s > 0):
            raise invalid("body_timeout_s", self.body_timeout_s, "be a number of seconds > 0",
                          "pass e.g. body_timeout_s=30")
        for pattern in self.allowed_hosts:
            if not isinstance(pattern, str) or not pattern or "*" in pattern[1:] or (
                    pattern.startswith("*") and pattern != "*" and not pattern.startswith("*.")):
                raise invalid("allowed_hosts", pattern, "be a host name, '*' (any) or a domain wildcard like "
                              "'*.example.com'", "pass e.g. allowed_hosts=('localhost', '*.example.com')")
        if self.api_key is not None and not self.api_key:
            raise invalid("api_key", self.api_key, "be a non-empty string or None", "pass a key, or None for none")


_ERROR_TYPES = {401: "authentication_error", 404: "not_found_error", 429: "rate_limit_error"}


def error_body(status: int, message: str, param: str | None = None) -> dict:
    """The OpenAI error object of an answer with HTTP `status`: `{"error": {"message", "type", "param", "code"}}`,
    the message cut by :func:`shorten`."""
    kind = _ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
    return {"error": {"message": shorten(message), "type": kind, "param": param, "code": None}}


def error_response(status: int, message: str, param: str | None = None, headers: dict | None = None):
    """:func:`error_body` as a `JSONResponse` with `status` and extra `headers`."""
    from fastapi.responses import JSONResponse

    return JSONResponse(error_body(status, message, param), status_code=status, headers=headers)


class HostCheckMiddleware:
    """ASGI middleware: Starlette's `TrustedHostMiddleware` check of the `Host` header against `allowed_hosts` (its
    parsing and patterns; no `www.` redirect), a refusal answered as 400 naming `Host` in the OpenAI error shape
    before any route runs (DNS rebinding of a loopback server)."""

    def __init__(self, app, allowed_hosts) -> None:
        from starlette.middleware.trustedhost import TrustedHostMiddleware

        self.app = app
        self.check = TrustedHostMiddleware(self._passed, allowed_hosts=list(allowed_hosts), www_redirect=False)

    @staticmethod
    async def _passed(scope, receive, send) -> None:
        scope["hf_dllm_spec.host_allowed"] = True

    async def __call__(self, scope, receive, send) -> None:
        async def swallow(message) -> None:          # Starlette's own plain-text refusal
            return None

        await self.check(scope, receive, swallow)
        if scope.pop("hf_dllm_spec.host_allowed", False) or scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        host = dict(scope.get("headers") or []).get(b"host", b"").decode("latin-1")
        message = str(invalid("Host", excerpt(host), "be one of the server's allowed hosts",
                              "call the server by a name it allows (its --allowed-hosts)"))
        await error_response(400, message, "Host")(scope, receive, send)


def key_matches(authorization: str | None, api_key: str) -> bool:
    """Whether an `Authorization` header value is `Bearer <api_key>` (scheme case-insensitive; the key compared
    in constant time)."""
    scheme, _, token = (authorization or "").partition(" ")
    return scheme.lower() == "bearer" and secrets.compare_digest(token.strip().encode(), api_key.encode())


def shorten(message: str, limit: int = MAX_MESSAGE_CHARS) -> str:
    """`message` cut to `limit` characters: its head (the field and the rule) and its tail (the fix)."""
    if len(message) <= limit:
        return message
    keep = (limit - 40) // 2
    return f"{message[:keep]} ... ({len(message) - 2 * keep} characters cut) ... {message[-keep:]}"


def check_json_values(body: Any, max_depth: int) -> None:
    """Refuse nesting deeper than `max_depth`, integers outside int64 (the top-level `seed`: outside uint64) and
    non-finite floats, anywhere in a parsed body (iterative: no recursion on deep input).

    Raises:
        RequestError: 400 naming the JSON path (`prompt[3]`, `messages[0].content`).
    """
    stack: list[tuple[Any, str, int]] = [(body, "body", 1)]
    while stack:
        value, path, depth = stack.pop()
        if isinstance(value, (dict, list)):
            if depth > max_depth:
                raise RequestError(str(invalid("body", f"<JSON nested deeper than {max_depth} at {path}>",
                                               f"nest arrays and objects at most {max_depth} deep",
                                               "send a flatter body (or raise the server's --max-json-depth)")))
            items = value.items() if isinstance(value, dict) else enumerate(value)
            for key, item in items:
                if isinstance(item, (dict, list, int, float)):
                    child = (key if path == "body" else f"{path}.{key}") if isinstance(value, dict) \
                        else f"{path if path != 'body' else ''}[{key}]"
                    stack.append((item, child, depth + 1))
        elif isinstance(value, bool):
            continue
        elif isinstance(value, int):
            high = UINT64_MAX if path == "seed" else INT64_MAX
            low = 0 if path == "seed" else INT64_MIN
            if not low <= value <= high:
                kind = "an unsigned 64-bit integer" if path == "seed" else "a 64-bit integer"
                raise RequestError(str(invalid(path, excerpt(value), f"be {kind} (in [{low}, {high}])",
                                               f"pass a `{path}` in that range")), param=path)
        elif isinstance(value, float) and not math.isfinite(value):
            raise RequestError(str(invalid(path, value, "be a finite number", f"pass a finite `{path}`")),
                               param=path)


def parse_json(raw: bytes, max_depth: int) -> Any:
    """The body as JSON (RFC 8259: no `NaN` / `Infinity`), checked by :func:`check_json_values`.

    Raises:
        RequestError: 400, quoting at most the parser's position (never the body).
    """
    from pydantic_core import from_json

    try:
        body = from_json(raw, allow_inf_nan=False)
    except ValueError as err:
        reason = str(err).splitlines()[0][:120]
        if "recursion limit" in reason:
            raise RequestError(str(invalid("body", f"<JSON nested deeper than {max_depth}>",
                                           f"nest arrays and objects at most {max_depth} deep",
                                           "send a flatter body"))) from None
        raise RequestError(str(invalid("body", f"<{len(raw)} bytes that are not JSON: {reason}>",
                                       "be one JSON object (RFC 8259: no NaN or Infinity)",
                                       "send e.g. {\"prompt\": \"...\", \"max_tokens\": 16}"))) from None
    check_json_values(body, max_depth)
    return body


def check_content_type(content_type: str | None) -> None:
    """Refuse a body that is not `application/json` (parameters such as `charset=utf-8` allowed).

    Raises:
        RequestError: 415.
    """
    media = (content_type or "").split(";")[0].strip().lower()
    if media != "application/json":
        raise RequestError(str(invalid("Content-Type", excerpt(content_type or None), "be application/json",
                                       "send the body as JSON with `Content-Type: application/json`")),
                           status=415, param="Content-Type")


class BodyLimitMiddleware:
    """ASGI middleware: a request body over `max_bytes` or slower than `timeout_s` never reaches the app whole.

    It wraps `receive`: the first read refuses a `Content-Length` over the limit (413) before any byte is read;
    every read counts the bytes received so far (413 as soon as they pass the limit) and waits at most until
    `timeout_s` after the first read (408). Once the body is complete, `receive` passes through unchanged (the
    disconnect listener of a streamed response). The refusals are :class:`RequestError` raised inside the
    handler's read, answered by the app's error handler.
    """

    def __init__(self, app, max_bytes: int, timeout_s: float) -> None:
        self.app, self.max_bytes, self.timeout_s = app, max_bytes, timeout_s

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length")
        state = {"received": 0, "deadline": None, "done": False}
        loop = asyncio.get_running_loop()

        async def limited_receive():
            if state["done"]:
                return await receive()
            if state["deadline"] is None:
                state["deadline"] = loop.time() + self.timeout_s
                if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
                    raise self._too_large(int(declared))
            try:
                message = await asyncio.wait_for(receive(), max(state["deadline"] - loop.time(), 0.0))
            except asyncio.TimeoutError:
                raise RequestError(str(invalid("body", f"<{state['received']} bytes received>",
                                               f"arrive within {self.timeout_s:g} s",
                                               "send the whole body at once")), status=408) from None
            if message["type"] == "http.request":
                state["received"] += len(message.get("body", b""))
                if state["received"] > self.max_bytes:
                    raise self._too_large(state["received"], so_far=True)
                state["done"] = not message.get("more_body", False)
            else:
                state["done"] = True
            return message

        await self.app(scope, limited_receive, send)

    def _too_large(self, size: int, so_far: bool = False) -> RequestError:
        what = f"at least {size} bytes" if so_far else f"{size} bytes"
        return RequestError(str(invalid("body", f"<{what}>", f"be at most {self.max_bytes} bytes "
                                        "(the server's --max-body-bytes)", "send a smaller request")), status=413)
