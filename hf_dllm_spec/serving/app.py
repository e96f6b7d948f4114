"""The OpenAI-compatible HTTP server: FastAPI routes over a :class:`~hf_dllm_spec.serving.batcher.Batcher`.

Routes: `POST /v1/completions`, `POST /v1/chat/completions` (JSON, or server-sent events with `stream=true`),
`GET /v1/models` (and `/v1/models/{id}`), `GET /health` (the queue and the batch in progress), `GET /metrics`
(Prometheus text, :mod:`~hf_dllm_spec.serving.metrics`). Responses are the `openai` package's own types (as in
transformers' `serve`), with two additions: `usage` in every response (also in the last streamed chunk) and
`dllm_stats`, the library's statistics of a completion's row (NFE, tokens per forward, acceptance rate), in each
choice (and at the top level of a response of one). A streamed response only carries final tokens in its choices;
with `stream_drafts=true` in the body (batch 1) it also carries, between them, chunks marked `dllm_draft` (`{"text",
"token_ids"}`: the provisional tokens after the final ones, e.g. the current block's argmax canvas or a drafter's
proposals, each replacing the previous one; transformers' `TextDiffusionStreamer` protocol). Errors are `{"error":
{"message", "type", "param"}}` with HTTP 4xx and the library's own message (at most
:data:`~.limits.MAX_MESSAGE_CHARS` characters: a big input is never echoed).

Limits (:class:`~hf_dllm_spec.serving.limits.ServerLimits`, the `serve` options): an API key for every route but
`/health` (401), the body's size (413), type (415) and arrival time (408), JSON depth and numbers (400), the
prompt's length (400) and the waiting requests (429 with `Retry-After`); see :mod:`~hf_dllm_spec.serving.limits`.
A request body is parsed and tokenized off the event loop (one worker thread), so a big prompt never stalls
`/health` or the streams in flight.

>>> served = load_served_model("models/sdar-tiny-arith", strategy="s2d2")   # doctest: +SKIP
>>> uvicorn.run(create_app(served), port=8000)                              # doctest: +SKIP
"""

from __future__ import annotations

import asyncio
import contextlib
import pathlib
import time
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..validation import invalid
from .batcher import Batcher, Job, Result
from .limits import (BodyLimitMiddleware, HostCheckMiddleware, ServerLimits, check_content_type, error_body,
                     error_response, key_matches, parse_json)
from .loading import LoadOptions
from .protocol import RequestError, ensure_chat_template, excerpt, parse_request, request_field


@dataclass
class ServedModel:
    """A loaded model and how the server decodes with it.

    Attributes:
        name (`str`): the `model` id clients pass (default: the checkpoint folder's name).
        model, tokenizer: the target and its tokenizer; drafter (*optional*): the strategies' `draft_model`.
        default_strategy (`str`): the strategy of requests that name none.
        default_params (`dict`): its parameters (`serve --param k=v`), under the request's own.
        default_max_tokens (`int`): the budget of requests without `max_tokens`.
        max_batch_size (`int`): most requests per batch.
        max_concurrent_batches (`int`): batches decoded at the same time (the batcher's worker threads; 1 with the
            static runtime).
        max_step_tokens (`int`, *optional*): most tokens a batch's largest forward (the prefill: rows x longest
            prompt) may hold; a longer prompt is refused (400).
    """

    name: str
    model: Any
    tokenizer: Any
    default_strategy: str
    drafter: Any = None
    default_params: dict = field(default_factory=dict)
    default_max_tokens: int = 256
    max_batch_size: int = 32
    max_concurrent_batches: int = 1
    max_step_tokens: int | None = None


def load_served_model(path: str, *, draft_model: str | None = None, strategy: str | None = None,
                      params: dict | None = None, dtype: str = "float32", device: str = "cpu",
                      name: str | None = None, cache_implementation: str | None = None,
                      loading: LoadOptions | None = None, **options: Any) -> ServedModel:
    """Load a checkpoint (and drafter) through the Auto classes, without remote code, with the loading options
    of `generate` (:mod:`~hf_dllm_spec.serving.loading`; `loading`, else `dtype` and `device`).

    The default strategy is `strategy`, else the one stored in the model's generation config, else its family's
    native decoding. A tokenizer without a chat template gets :data:`~.protocol.MINIMAL_CHAT_TEMPLATE` (in memory).
    `cache_implementation` ("static": the static runtime for every batch, drafter included) is set on the model's
    generation config, as a transformers user would; the batcher decodes one batch at a time, as the static
    runtime requires.

    Raises:
        ValueError: no strategy can be chosen (a plain causal LM: pass `strategy`), a bad strategy parameter, a
            default strategy that drafts with a separate model and no `draft_model`, or one the model cannot decode
            (:func:`check_servable`).
    """
    from ..strategies.registry import get_strategy, resolve_config
    from .loading import load_models

    def check_drafter(name: str, has_drafter: bool) -> None:
        if get_strategy(name).uses_drafter and not has_drafter:
            raise invalid("strategy", name, "have a drafter to serve as the default strategy: it drafts with a "
                          "separate model", "pass --draft-model PATH (draft_model=...), or another --strategy")

    loading = loading if loading is not None else LoadOptions(dtype=dtype, device=device)
    loading.check()
    if strategy is not None:             # a bad option fails before anything is loaded
        resolve_config(strategy, overrides=params or {})
        check_drafter(strategy, draft_model is not None)
    tokenizer, model, drafter = load_models(path, draft_model, loading)
    if cache_implementation is not None:
        model.generation_config.cache_implementation = cache_implementation
    default = strategy or (model.default_decoding_strategy() if hasattr(model, "default_decoding_strategy")
                           else None)
    if default is None:
        raise invalid("strategy", None, f"be given for model_type `{model.config.model_type}`, which stores no "
                      "decoding strategy", "pass --strategy ar (or a strategy with --draft-model)")
    resolve_config(default, generation_config=model.generation_config, overrides=params or {})
    check_drafter(default, drafter is not None)
    check_servable(model, drafter, default, params or {},
                   options.get("default_max_tokens", ServedModel.default_max_tokens))
    ensure_chat_template(tokenizer)
    return ServedModel(name or pathlib.Path(path).name, model, tokenizer, default, drafter, dict(params or {}),
                       **options)


def check_servable(model, drafter, strategy: str, params: dict, max_tokens: int) -> None:
    """Refuse a default strategy the served model cannot decode (a strategy that needs a mask token on an AR model,
    a drafter of another vocabulary, a block beyond the model's positions, ...), so that no request is refused for
    a setting of the server: the library's own checks of a call (its plan; no forward runs) on a typical request,
    a prompt of 64 tokens and a budget of `max_tokens` up to 64, greedy or else sampled (a stochastic acceptance
    rule serves sampled requests); `drafter` only where the strategy drafts with it (the others serve requests that
    name a drafting strategy). Rules of a request's own lengths stay the request's.

    Raises:
        ValueError: the library's refusal of the greedy call, naming the setting (`decoding_strategy`, a strategy
            parameter, `mask_token_id`, `draft_model`, ...).
    """
    import copy

    import torch

    import model_patches

    from ..integration.plan import build_plan
    from ..runtime.weights import execution_device
    from ..strategies.registry import get_strategy

    positions = model_patches.get_patch(model).max_positions(model) or 128
    drafter = drafter if get_strategy(strategy).uses_drafter else None
    masks = {getattr(m.config, "mask_token_id", None) for m in (model, drafter) if m is not None}
    masks |= {getattr(m.generation_config, "mask_token_id", None) for m in (model, drafter) if m is not None}
    token = next(t for t in range(4) if t not in masks)
    length = max(1, min(64, positions // 2))              # the typical prompt, and the most of the budget checked
    ids = torch.full((1, length), token, device=execution_device(model))

    def plan(do_sample: bool) -> None:
        config = copy.deepcopy(model.generation_config)
        config.max_new_tokens, config.do_sample = max(1, min(max_tokens, length)), do_sample
        build_plan(model, ids, config, {}, decoding_strategy=strategy, overrides=dict(params), strategy_config=None,
                   preset=None, draft_model=drafter, mask_token_id=None, draft_mask_token_id=None,
                   generator=torch.Generator(ids.device) if do_sample else None, streamer=None,
                   stopping_criteria=None)

    try:
        plan(do_sample=False)
    except ValueError as greedy_refusal:
        try:
            plan(do_sample=True)
        except ValueError:
            raise greedy_refusal from None


class TextDeltas:
    """Token ids -> text increments, decoded over a short window of ids (incremental detokenization as TGI and
    vLLM do it): each call decodes only the ids since the one before the last text sent, not the whole output, and
    text that ends in an incomplete UTF-8 character ("\\ufffd") is held back until the character is complete.

    The window starts one emission back so that a tokenizer's context-dependent decoding (a leading space, a
    byte sequence) reads the same as in the whole decode; the increments join to
    `tokenizer.decode(all ids, skip_special_tokens=True)`.
    """

    def __init__(self, tokenizer) -> None:
        self.tokenizer, self.ids = tokenizer, []
        self.prefix = self.read = 0         # ids[prefix:read]: the context of the text sent; ids[:read]: sent

    def _new_text(self, extra: list[int] = ()) -> str:
        """The text of `ids[read:] + extra`, decoded after its context `ids[prefix:read]`."""
        context = self.tokenizer.decode(self.ids[self.prefix:self.read], skip_special_tokens=True)
        return self.tokenizer.decode(self.ids[self.prefix:] + list(extra), skip_special_tokens=True)[len(context):]

    def add(self, ids: list[int], final: bool = False) -> str:
        """Append `ids` and return the text they add to what was returned before.

        Args:
            ids (`list[int]`): the new token ids.
            final (`bool`, defaults to False): no more ids come; the text is returned even when it ends in an
                incomplete UTF-8 character.

        Returns:
            `str`: the new text (special tokens skipped); "" while it ends in "\\ufffd" and `final` is False (the
            held-back text comes with a later call).
        """
        self.ids += ids
        text = self._new_text()
        if not text or (text.endswith("\ufffd") and not final):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return text

    def draft(self, draft_ids: list[int]) -> str:
        """The text a provisional draft adds to what was returned so far: it carries the held-back ids (the bytes
        of a character the draft completes), and a character the draft itself leaves incomplete is dropped.

        Args:
            draft_ids (`list[int]`): the draft's token ids, after every id given to :meth:`add`.

        Returns:
            `str`: the text that "text so far + draft" shows.
        """
        return self._new_text(draft_ids).rstrip("\ufffd")


#: Seconds between two looks for a client that went away while its (non-streamed) request waits or decodes.
DISCONNECT_POLL_S = 0.25


class Choices:
    """The completions of one request (a :class:`~.batcher.Job` each, rows of the batcher) and their events, merged
    in the order they arrive as `(choice, (kind, payload))` on one queue.

    Args:
        rows (`list[ParsedRequest]`): the request's completions, in the order of its `choices`.
        loop: the request's event loop.
    """

    def __init__(self, rows: list, loop: asyncio.AbstractEventLoop) -> None:
        self.events: asyncio.Queue = asyncio.Queue()
        self.jobs = [Job(row, loop, _ChoiceEvents(self.events, i)) for i, row in enumerate(rows)]
        self.prompt_tokens = sum(len(row.prompt_ids) for row in rows if row.sample == 0)

    def cancel(self) -> None:
        """End every completion still decoding (a no-op for those done): their rows leave at the next join point."""
        for job in self.jobs:
            job.cancelled.set()

    def ready(self) -> list[tuple[int, tuple]]:
        """The events already arrived, without waiting."""
        out = []
        while not self.events.empty():
            out.append(self.events.get_nowait())
        return out

    async def start(self, request: Request) -> list[tuple[int, tuple]] | None:
        """The first event and those already behind it (a refusal of a row is made before its batch's first
        forward, so refusals of rows that start together come first); None once the client has disconnected. A
        streamed response starts then: a completion still waiting for a free row does not hold the others' tokens
        back, and one the library refuses later ends the stream with an error event."""
        first = await self.next(request)
        return None if first is None else [first, *self.ready()]

    async def next(self, request: Request) -> tuple[int, tuple] | None:
        """The next event, or None once the client has disconnected (every completion is cancelled then, so their
        rows leave the batch at the next join point). A streamed response notices by itself (its sends fail); a
        non-streamed one only by looking (uvicorn does not cancel the handler)."""
        while True:
            if await request.is_disconnected():          # before every event too: they may come faster than the poll
                self.cancel()
                return None
            try:
                return await asyncio.wait_for(self.events.get(), DISCONNECT_POLL_S)
            except asyncio.TimeoutError:
                pass


class _ChoiceEvents:
    """The `events` of one completion's :class:`~.batcher.Job`: an event goes to the request's queue with the
    completion's index."""

    def __init__(self, queue: asyncio.Queue, index: int) -> None:
        self.queue, self.index = queue, index

    def put_nowait(self, event: tuple) -> None:
        self.queue.put_nowait((self.index, event))


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _sse(payload: dict) -> str:
    import json

    return f"data: {json.dumps(payload)}\n\n"


def create_app(served: ServedModel, limits: ServerLimits | None = None) -> FastAPI:
    """The FastAPI app serving `served` under `limits` (default :class:`ServerLimits()`: no key, 4 MiB bodies);
    its batcher thread starts now and stops at the app's shutdown."""
    import concurrent.futures
    from contextlib import asynccontextmanager

    limits = limits if limits is not None else ServerLimits()
    batcher = Batcher(served.model, served.drafter, max_batch_size=served.max_batch_size,
                      workers=served.max_concurrent_batches, max_step_tokens=served.max_step_tokens)
    try:                                   # the `serve` extra has it; without it /metrics answers 501
        from .metrics import ServerMetrics

        metrics = batcher.observer = ServerMetrics(batcher.status)
    except ImportError:
        metrics = None
    parser = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="hf-dllm-spec-parse")
    vocab_size = served.model.get_input_embeddings().num_embeddings

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        batcher.close()
        parser.shutdown(wait=False)

    # FastAPI's own pages (/docs, /redoc, /openapi.json) cannot sit behind the key: off when there is one.
    pages = {} if limits.api_key is None else dict(docs_url=None, redoc_url=None, openapi_url=None)
    app = FastAPI(title="hf-dllm-spec", lifespan=lifespan, **pages)
    app.state.served, app.state.batcher, app.state.limits, app.state.metrics = served, batcher, limits, metrics
    app.add_middleware(BodyLimitMiddleware, max_bytes=limits.max_body_bytes, timeout_s=limits.body_timeout_s)
    if tuple(limits.allowed_hosts) != ("*",):
        app.add_middleware(HostCheckMiddleware, allowed_hosts=limits.allowed_hosts)
    created = int(time.time())

    @app.exception_handler(RequestError)
    async def request_error(request: Request, err: RequestError) -> JSONResponse:
        return error_response(err.status, str(err), err.param, err.headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, err: StarletteHTTPException) -> JSONResponse:
        return error_response(err.status_code, str(err.detail), None, getattr(err, "headers", None))

    @app.exception_handler(Exception)
    async def server_error(request: Request, err: Exception) -> JSONResponse:
        """Anything else is the server's fault: 500 in the same JSON shape, naming only the exception's type (its
        text may hold paths or data; Starlette re-raises it and uvicorn logs the traceback)."""
        return error_response(500, f"internal server error ({type(err).__name__}); the server's log has the "
                                   "traceback")

    async def require_key(request: Request) -> None:
        """401 unless the request carries `Authorization: Bearer <key>` (when the server has a key)."""
        if limits.api_key is not None and not key_matches(request.headers.get("authorization"), limits.api_key):
            raise RequestError("`Authorization` must be `Bearer <key>` with the server's API key; pass the key as "
                               "the `openai` client's api_key (or the header `Authorization: Bearer <key>`)",
                               status=401, param="Authorization", headers={"WWW-Authenticate": "Bearer"})

    keyed = APIRouter(dependencies=[Depends(require_key)])

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok", "model": served.name, **batcher.status()}

    model_card = {"id": served.name, "object": "model", "created": created, "owned_by": "hf-dllm-spec"}

    @keyed.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [model_card]}

    @keyed.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict:
        if model_id != served.name:
            raise RequestError(str(invalid("model", excerpt(model_id), f"be the served model {served.name!r}",
                                           "list the served models at /v1/models")), status=404, param="model")
        return model_card

    @keyed.get("/metrics")
    async def prometheus_metrics() -> Response:
        if metrics is None:
            raise RequestError("/metrics needs the `prometheus_client` package (the `serve` extra): pip install "
                               "prometheus_client", status=501)
        return Response(metrics.exposition(), media_type=metrics.content_type)

    def parse(raw: bytes, chat: bool):
        body = parse_json(raw, limits.max_json_depth)
        return parse_request(body, chat=chat, tokenizer=served.tokenizer, served_name=served.name,
                             default_strategy=served.default_strategy, default_params=served.default_params,
                             generation_config=served.model.generation_config,
                             default_max_tokens=served.default_max_tokens, vocab_size=vocab_size,
                             max_prompt_tokens=limits.max_prompt_tokens, has_drafter=served.drafter is not None)

    async def handle(request: Request, chat: bool):
        check_content_type(request.headers.get("content-type"))
        raw = await request.body()                      # BodyLimitMiddleware: 413 / 408 while it arrives
        loop = asyncio.get_running_loop()
        rows = await loop.run_in_executor(parser, parse, raw, chat)
        longest = max(rows, key=lambda row: len(row.prompt_ids))
        field = request_field(longest.prompt_field)
        if served.max_step_tokens is not None and len(longest.prompt_ids) > served.max_step_tokens:
            raise RequestError(str(invalid(longest.prompt_field, f"<prompt of {len(longest.prompt_ids)} tokens>",
                                           f"fit one forward of at most {served.max_step_tokens} tokens (the "
                                           "server's --max-step-tokens)", "send a shorter prompt")), param=field)
        most = None if limits.max_waiting is None else limits.max_waiting + served.max_batch_size
        if most is not None and len(rows) > most:       # more than an idle server runs and queues: never admitted
            n = max(row.sample for row in rows) + 1
            name = "n" if n > 1 else field
            raise RequestError(str(invalid(name, n if n > 1 else f"<{len(rows)} prompts>", f"ask for at most {most} "
                                           f"completions (the server's --max-batch-size rows plus its --max-waiting; "
                                           f"{len(rows)} asked)", "send fewer per request")), param=name)
        status = batcher.status()
        if limits.max_waiting is not None and status["queued"] + len(rows) > limits.max_waiting and (
                status["running"] or status["queued"]):          # an idle batcher takes the request at once
            raise RequestError(f"the server has {status['queued']} requests waiting and this one asks for "
                               f"{len(rows)} (its --max-waiting is {limits.max_waiting}); retry after the time in "
                               "`Retry-After`", status=429, headers={"Retry-After": str(batcher.retry_after())})
        choices = Choices(rows, loop)
        batcher.submit(*choices.jobs)                   # together: they start in one batch where rows are free
        try:
            backlog = await choices.start(request)   # the library refuses a request before any forward
        except BaseException:
            choices.cancel()
            raise
        if backlog is None:
            return Response(status_code=499)          # the client went away (nobody reads this answer)
        refused = next((event[1] for _, event in backlog if event[0] == "error"), None)
        if refused is not None:
            choices.cancel()
            return error_response(*refused)
        shape = (_ChatShape if chat else _TextShape)(choices.jobs[0], served.name)
        if rows[0].stream:
            return StreamingResponse(_stream(choices, backlog, shape, served.tokenizer),
                                     media_type="text/event-stream")
        results: dict[int, Result] = {i: payload for i, (kind, payload) in backlog if kind == "done"}
        try:
            while len(results) < len(choices.jobs):
                got = await choices.next(request)
                if got is None:
                    return Response(status_code=499)
                i, (kind, payload) = got
                if kind == "error":
                    return error_response(*payload)
                if kind == "done":
                    results[i] = payload
        finally:
            choices.cancel()                   # no-op once done; frees the rows if the client went away
        outputs = [(served.tokenizer.decode(results[i].tokens, skip_special_tokens=True), results[i])
                   for i in range(len(choices.jobs))]
        return JSONResponse(shape.whole(outputs, choices.prompt_tokens))

    @keyed.post("/v1/completions")
    async def completions(request: Request):
        return await handle(request, chat=False)

    @keyed.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await handle(request, chat=True)

    app.include_router(keyed)
    return app


class _TextShape:
    """`/v1/completions` payloads (`Completion`, `text_completion` chunks); choice `i` of a request's completions."""

    object = whole_object = "text_completion"

    def __init__(self, job: Job, model: str) -> None:
        self.base = {"id": job.id, "created": int(time.time()), "model": model}

    def choice(self, i: int, text: str, finish_reason: str | None) -> dict:
        return {"index": i, "text": text, "finish_reason": finish_reason, "logprobs": None}

    def whole(self, outputs: list[tuple[str, Result]], prompt_tokens: int) -> dict:
        """The response: a choice per completion `(text, result)`, each with the library's statistics of its row in
        `dllm_stats` (with one completion, also at the top level); `usage` of them all."""
        choices = [{**self.choice(i, text, result.finish_reason), "dllm_stats": result.stats}
                   for i, (text, result) in enumerate(outputs)]
        body = {**self.base, "object": self.whole_object, "choices": choices,
                "usage": _usage(prompt_tokens, sum(len(result.tokens) for _, result in outputs))}
        return body if len(outputs) > 1 else {**body, "dllm_stats": outputs[0][1].stats}

    def first(self, i: int) -> list[dict]:
        return []

    def chunk(self, i: int, text: str, finish_reason: str | None = None) -> dict:
        return {**self.base, "object": self.object, "choices": [self.choice(i, text, finish_reason)]}

    def draft(self, i: int, text: str, token_ids: list[int]) -> dict:
        """A chunk that adds no text and carries a provisional draft in `dllm_draft` (it replaces the previous
        draft; final text only ever arrives in the choices)."""
        return {**self.chunk(i, ""), "dllm_draft": {"text": text, "token_ids": token_ids}}


class _ChatShape(_TextShape):
    """`/v1/chat/completions` payloads (`ChatCompletion`, `chat.completion.chunk`)."""

    object, whole_object = "chat.completion.chunk", "chat.completion"

    def __init__(self, job: Job, model: str) -> None:
        super().__init__(job, model)
        self.base["id"] = "chat" + job.id

    def choice(self, i: int, text: str, finish_reason: str | None) -> dict:
        return {"index": i, "message": {"role": "assistant", "content": text}, "finish_reason": finish_reason,
                "logprobs": None}

    def first(self, i: int) -> list[dict]:
        return [{**self.base, "object": self.object,
                 "choices": [{"index": i, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]}]

    def chunk(self, i: int, text: str, finish_reason: str | None = None) -> dict:
        return {**self.base, "object": self.object,
                "choices": [{"index": i, "delta": {"content": text} if text else {}, "finish_reason": finish_reason}]}


async def _stream(choices: Choices, backlog: list, shape: _TextShape, tokenizer):
    """Server-sent events: for each completion (`index`), a chunk per batch of its newly final tokens, the last
    with `finish_reason` and its `dllm_stats`; the last chunk of all carries the request's `usage`; then `[DONE]`.
    A client that goes away cancels the completions, which frees their rows."""
    deltas = [TextDeltas(tokenizer) for _ in choices.jobs]
    left, completion_tokens = len(choices.jobs), 0
    try:
        for i in range(len(choices.jobs)):
            for payload in shape.first(i):
                yield _sse(payload)
        while left:
            events = (backlog or [await choices.events.get()]) + choices.ready()
            backlog, ids = [], {}
            for i, (kind, payload) in events:
                if kind == "tokens":               # everything final so far, in one chunk per completion
                    ids.setdefault(i, []).extend(payload)
                    continue
                if i in ids and (text := deltas[i].add(ids.pop(i))):
                    yield _sse(shape.chunk(i, text))
                if kind == "draft":
                    yield _sse(shape.draft(i, deltas[i].draft(payload), payload))
                elif kind == "error":
                    yield _sse(error_body(*payload))
                    return
                else:
                    left, completion_tokens = left - 1, completion_tokens + len(payload.tokens)
                    final = shape.chunk(i, deltas[i].add([], final=True), payload.finish_reason)
                    final["dllm_stats"] = payload.stats
                    if not left:
                        final["usage"] = _usage(choices.prompt_tokens, completion_tokens)
                    yield _sse(final)
            for i, new in ids.items():
                if text := deltas[i].add(new):
                    yield _sse(shape.chunk(i, text))
        yield "data: [DONE]\n\n"
    finally:
        choices.cancel()                     # no-op for the completions done


@contextlib.contextmanager
def serve_in_background(app: FastAPI, host: str = "127.0.0.1", port: int = 0, timeout: float = 60.0,
                        **uvicorn_options: Any):
    """Run `app` with uvicorn in a daemon thread of this process until the block ends; yields the base URL
    (`http://host:port`; port 0 picks a free one; `uvicorn_options` go to `uvicorn.Config`). For tests and
    benchmarks.

    Raises:
        RuntimeError: the server did not start within `timeout` seconds.
    """
    import socket
    import threading

    import uvicorn

    listener = socket.socket()              # bound here and handed over: port 0 is never free for another taker
    listener.bind((host, port))
    port = listener.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning", **uvicorn_options))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [listener]}, name="hf-dllm-spec-uvicorn",
                              daemon=True)
    try:
        thread.start()
        deadline = time.monotonic() + timeout
        while not server.started:
            if time.monotonic() > deadline or not thread.is_alive():
                raise RuntimeError(f"the server did not start on {host}:{port} within {timeout:g} s")
            time.sleep(0.02)
        yield f"http://{host}:{port}"
    finally:
        server.should_exit = True
        if thread.is_alive():
            thread.join(timeout)
        listener.close()
