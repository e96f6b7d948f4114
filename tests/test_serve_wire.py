"""The server on the wire (raw HTTP, the standard library): the OpenAI framing of streams, request fields at their
boundaries, the limits at theirs, and batching at `--max-batch-size` / `--max-step-tokens`. Each test pins a rule a
mutation of `hf_dllm_spec/serving/` broke without any other test failing.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import http.client
import json
import pathlib
import re
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from hf_dllm_spec.serving.app import create_app, load_served_model, serve_in_background  # noqa: E402
from hf_dllm_spec.serving.limits import ServerLimits  # noqa: E402
from recipes.arithmetic import format_prompt  # noqa: E402
from test_serve import health  # noqa: E402
from test_serve_limits import long_stream, request  # noqa: E402

MODEL = pathlib.Path(__file__).resolve().parents[1] / "models" / "sdar-tiny-arith"
PROMPT = "Question: 2 + 3?\nAnswer:"
CHAT = [{"role": "user", "content": "2 + 3?"}]


@pytest.fixture(scope="module")
def served(one_thread):
    return load_served_model(str(MODEL))


@pytest.fixture(scope="module")
def base(served):
    with serve_in_background(create_app(served, ServerLimits())) as url:
        yield url


@contextlib.contextmanager
def serving(served, limits: ServerLimits | None = None, **changes):
    """A server of its own: `served` with `changes` (its batching options), under `limits`."""
    model = dataclasses.replace(served, **changes) if changes else served
    with serve_in_background(create_app(model, limits or ServerLimits())) as url:
        yield url


def post(url: str, path: str, body, headers: dict | None = None) -> tuple[int, dict, str]:
    """(status, headers, body text) of one JSON POST; `body` a dict (sent as JSON) or the raw text."""
    return request(url, "POST", path, body if isinstance(body, str) else json.dumps(body),
                   {"Content-Type": "application/json", **(headers or {})}, timeout=120)


def events(text: str) -> list[str]:
    """The `data:` payloads of a server-sent event stream, in order."""
    return [line[len("data: "):] for line in text.split("\n") if line.startswith("data: ")]


# -- the OpenAI framing --------------------------------------------------------------------------------------------

def test_a_stream_ends_with_done_and_counts_its_prompt(served, base):
    status, _, text = post(base, "/v1/completions", {"prompt": PROMPT, "max_tokens": 4, "stream": True})
    payloads = events(text)
    assert status == 200 and payloads[-1] == "[DONE]"
    usage = json.loads(payloads[-2])["usage"]
    prompt_tokens = len(served.tokenizer(PROMPT)["input_ids"])
    assert usage["prompt_tokens"] == prompt_tokens and usage["total_tokens"] == prompt_tokens + usage[
        "completion_tokens"]


def test_a_chat_stream_opens_with_the_assistant_role_and_closes_with_an_empty_delta(base):
    status, _, text = post(base, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 4, "stream": True})
    chunks = [json.loads(p) for p in events(text) if p != "[DONE]"]
    assert status == 200 and chunks[0]["id"].startswith("chatcmpl-")
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunks[-1]["choices"][0]["delta"] == {} and chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")


def test_max_completion_tokens_wins_over_max_tokens(base):
    status, _, text = post(base, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 9,
                                                          "max_completion_tokens": 2, "ignore_eos": True})
    assert status == 200 and json.loads(text)["usage"]["completion_tokens"] == 2


# -- request fields at their boundaries -----------------------------------------------------------------------------

@pytest.mark.parametrize("field,value", [("n", 0), ("min_tokens", 1)])
def test_fields_just_past_their_rule_are_refused(base, field, value):
    """`n` must be at least 1 (0 was served), `min_tokens` needs `ignore_eos` from 1 token on (1 was served)."""
    status, _, text = post(base, "/v1/completions", {"prompt": PROMPT, "max_tokens": 4, field: value})
    assert status == 400 and json.loads(text)["error"]["param"] == field, text


@pytest.mark.parametrize("stop", [[], "", None])
def test_an_empty_stop_asks_for_nothing(base, stop):
    status, _, text = post(base, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2, "stop": stop})
    assert status == 200, text


def test_seed_zero_is_a_seed(base):
    """`seed=0` sampled with a fresh random seed (a truthiness test): three requests, three texts."""
    body = {"prompt": PROMPT, "max_tokens": 32, "temperature": 3.0, "seed": 0, "ignore_eos": True}
    texts = {json.loads(post(base, "/v1/completions", body)[2])["choices"][0]["text"] for _ in range(3)}
    assert len(texts) == 1


# -- limits at their boundaries -------------------------------------------------------------------------------------

def test_limits_hold_at_their_boundaries(served):
    """A body of exactly `max_body_bytes` is read and nested exactly `max_json_depth` deep is parsed (one byte or
    level more is refused); the bearer scheme is case-insensitive (RFC 7235); a prompt of exactly
    `--max-step-tokens` tokens is served."""
    raw = json.dumps({"messages": CHAT, "max_tokens": 1})                 # depth 3: {} -> [] -> {}
    limits = ServerLimits(api_key="k", max_body_bytes=len(raw), max_json_depth=3)
    with serving(served, limits, max_step_tokens=12) as url:
        auth = {"Authorization": "bearer k"}
        assert post(url, "/v1/chat/completions", raw, auth)[0] == 200
        assert post(url, "/v1/chat/completions", raw + " ", auth)[0] == 413
    with serving(served, ServerLimits(max_json_depth=3), max_step_tokens=12) as url:
        assert post(url, "/v1/completions", {"prompt": list(range(5, 17)), "max_tokens": 1})[0] == 200
        assert post(url, "/v1/completions", {"prompt": list(range(5, 18)), "max_tokens": 1})[0] == 400
        assert post(url, "/v1/chat/completions", {"messages": [{"role": "user", "content": [
            {"type": "text", "text": "2 + 3?"}]}], "max_tokens": 1})[0] == 400           # depth 5


# -- batching at its bounds -----------------------------------------------------------------------------------------

def test_a_request_joins_a_running_call_up_to_the_bounds_and_no_further(served):
    """`--max-batch-size 1`: a request sent while a long stream decodes waits for it (it joined: batch size 2). Two
    prompts of 10 tokens under `--max-step-tokens 20` fit exactly (the joiner was kept out), under 19 they do not."""
    ten = list(range(5, 15))
    for changes, expected in (({"max_batch_size": 1}, 1), ({"max_step_tokens": 20}, 2),
                              ({"max_step_tokens": 19}, 1)):
        with serving(served, **changes) as url, concurrent.futures.ThreadPoolExecutor(1) as pool:
            with long_stream(url, prompt=ten) as stream:
                reply = pool.submit(post, url, "/v1/completions", {"prompt": ten, "max_tokens": 4})
                if expected == 2:
                    reply.result(timeout=60)                 # it joins at the stream's next join point
                else:
                    deadline = time.monotonic() + 30
                    while not health(url)["queued"] and time.monotonic() < deadline:
                        time.sleep(0.02)
                    for _ in range(40):                      # many steps, so many join points, pass meanwhile
                        stream.readline()
            status, _, text = reply.result(timeout=60)       # the stream's client left: a waiting request runs
            assert status == 200 and json.loads(text)["dllm_stats"]["batch_size"] == expected, (changes, text)


def test_a_stream_drafts_client_that_leaves_frees_its_row(served):
    """A disconnected `stream_drafts` client decoded its whole budget (its criterion ignored the cancellation) and
    was counted as finished by length."""
    app = create_app(served, ServerLimits())
    with serve_in_background(app) as url:
        with long_stream(url, stream_drafts=True) as response:
            response.readline()
        deadline = time.monotonic() + 60
        while health(url)["running"] and time.monotonic() < deadline:
            time.sleep(0.05)
        conn = http.client.HTTPConnection(url.split("//")[1], timeout=10)
        conn.request("GET", "/metrics")
        metrics = conn.getresponse().read().decode()
        conn.close()
    row = app.state.batcher.history[-1]
    assert row["finish_reason"] == "cancelled" and row["tokens"] < 1500, row
    assert 'finish_reason="cancelled"' in metrics and 'finish_reason="length"' not in metrics


def test_a_stream_drafts_request_runs_alone_beside_a_waiting_request_of_its_options(served):
    """A greedy request and a greedy `stream_drafts` request wait behind a sampled call (other options): when it
    ends, the first runs; the `stream_drafts` one runs alone after it, streaming its drafts (they started one call,
    and it got no draft and a batch of 2)."""
    app = create_app(served, ServerLimits())
    with serve_in_background(app) as url, concurrent.futures.ThreadPoolExecutor(2) as pool:
        with long_stream(url, temperature=1.0, seed=1):
            plain = pool.submit(post, url, "/v1/completions", {"prompt": PROMPT, "max_tokens": 8})
            deadline = time.monotonic() + 30
            while health(url)["queued"] < 1 and time.monotonic() < deadline:
                time.sleep(0.01)
            drafts = pool.submit(post, url, "/v1/completions", {"prompt": "Question: 4 + 1?\nAnswer:",
                                                                "max_tokens": 16, "stream": True,
                                                                "stream_drafts": True})
            while health(url)["queued"] < 2 and time.monotonic() < deadline:
                time.sleep(0.01)
            assert health(url)["running"] == 1 and health(url)["queued"] == 2
        status, _, text = drafts.result(timeout=60)
        assert plain.result(timeout=60)[0] == 200
    chunks = [json.loads(p) for p in events(text) if p != "[DONE]"]
    assert status == 200 and any("dllm_draft" in c for c in chunks)
    assert chunks[-1]["dllm_stats"]["batch_size"] == 1


def test_the_minimal_chat_template_and_the_tokens_per_forward_gauge(served):
    """A chat of one user message is prompted as the bundled models were trained ("Question: ...\\nAnswer:", no
    trailing space); `tokens_per_forward` is the request's completion tokens over its forwards."""
    app = create_app(served, ServerLimits())
    with serve_in_background(app) as url:
        status, _, text = post(url, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 16, "ignore_eos": True})
        conn = http.client.HTTPConnection(url.split("//")[1], timeout=10)
        conn.request("GET", "/metrics")
        metrics = conn.getresponse().read().decode()
        conn.close()
    reply = json.loads(text)
    expected = served.tokenizer(format_prompt("2 + 3?"), add_special_tokens=False)["input_ids"]   # the training format
    assert status == 200 and reply["usage"]["prompt_tokens"] == len(expected)
    gauge = [line for line in metrics.splitlines() if line.startswith("hf_dllm_spec_tokens_per_forward{")]
    assert len(gauge) == 1 and float(gauge[0].split()[-1]) == pytest.approx(
        reply["usage"]["completion_tokens"] / reply["dllm_stats"]["nfe"])


def test_retry_after_counts_the_batches_the_queue_fills(served):
    """`--max-waiting 1`, `--max-batch-size 1`, no batch finished yet (1 s each, the default): one long stream runs
    and one waits, so a third request waits for 1 + 1 batches: `Retry-After: 2` (it said 1)."""
    limits = ServerLimits(max_waiting=1)
    with serving(served, limits, max_batch_size=1) as url, concurrent.futures.ThreadPoolExecutor(1) as pool:
        with long_stream(url):
            waiting = pool.submit(post, url, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2})
            deadline = time.monotonic() + 30
            while not health(url)["queued"] and time.monotonic() < deadline:
                time.sleep(0.02)
            status, headers, text = post(url, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2})
        assert waiting.result(timeout=60)[0] == 200
    retry = {k.lower(): v for k, v in headers.items()}["retry-after"]
    assert status == 429 and json.loads(text)["error"]["type"] == "rate_limit_error" and retry == "2", (retry, text)


# -- chat messages, routes and error answers ------------------------------------------------------------------------

TOOL_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}"
    "{% if m.get('name') %} (name {{ m['name'] }}){% endif %}"
    "{% for call in m.get('tool_calls') or [] %} call {{ call['function']['name'] }}"
    "{% set arguments = call['function']['arguments'] %}{% if arguments is mapping %}"
    "{% for k, v in arguments.items() %} {{ k }}={{ v }}{% endfor %}{% else %} {{ arguments }}{% endif %}{% endfor %}"
    "{% if m.get('tool_call_id') %} for {{ m['tool_call_id'] }}{% endif %}{{ '\\n' }}{% endfor %}"
    "{% if messages[0]['role'] == 'wizard' %}{{ raise_exception('no wizards') }}{% endif %}"
)


@pytest.fixture(scope="module")
def tool_tokenizer(served):
    import copy

    tokenizer = copy.deepcopy(served.tokenizer)
    tokenizer.chat_template = TOOL_TEMPLATE
    return tokenizer


def test_chat_messages_reach_the_template_as_transformers_serve_passes_them(tool_tokenizer):
    """Text parts joined with spaces (chat's "text" and the Responses API's "input_text"), an assistant turn without
    content, its tool calls with their JSON arguments parsed (templates iterate them), `tool_call_id` and `name`
    (all dropped before: the template saw neither the calls nor the names); an assistant's refusal part is its
    text, and arguments that are not JSON stay text."""
    from hf_dllm_spec.serving.protocol import chat_prompt

    messages = [
        {"role": "user", "content": [{"type": "text", "text": "2 +"}, {"type": "input_text", "text": "3?"}],
         "name": "ann"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}]},
        {"role": "tool", "content": "5", "tool_call_id": "c1"},
        {"role": "assistant", "content": [{"type": "refusal", "refusal": "no."}], "tool_calls": [
            {"id": "c2", "type": "function", "function": {"name": "f", "arguments": "not json"}}]},
    ]
    expected = ("user: 2 + 3? (name ann)\nassistant:  call add a=2 b=3\ntool: 5 for c1\n"
                "assistant: no. call f not json\n")
    assert chat_prompt({"messages": messages}, tool_tokenizer) == tool_tokenizer(
        expected, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("message, where", [
    ({"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "image_url", "image_url": {"url": "x"}}]},
     "`messages[0].content[1]`"),                                      # an image the text model would never see
    ({"role": "user", "content": ["2 + 3?"]}, "`messages[0].content[0]`"),          # not a part: an empty prompt
    ({"role": "user", "content": [{"text": "2 + 3?"}]}, "`messages[0].content[0]`"),  # a part without its type
    ({"role": "user"}, "`messages[0].content`"),                      # no content: an empty user turn
    ({"role": "user", "content": None}, "`messages[0].content`"),
    ({"role": "user", "content": 0}, "`messages[0].content`"),
    ({"role": "user", "content": False}, "`messages[0].content`"),
    ({"role": "assistant", "content": "", "tool_calls": [{"function": {"arguments": "{}"}}]},    # no name
     "`messages[0].tool_calls[0]`"),
    ({"role": "tool", "content": "5", "tool_call_id": 7}, "`messages[0].tool_call_id`"),
    ({"role": "assistant", "content": "", "tool_calls": 5}, "`messages[0].tool_calls`"),   # was a TypeError: 500
])
def test_chat_messages_a_text_model_cannot_read_are_refused(tool_tokenizer, message, where):
    from hf_dllm_spec.serving.protocol import RequestError, chat_prompt

    with pytest.raises(RequestError, match=re.escape(where)) as refused:
        chat_prompt({"messages": [message]}, tool_tokenizer)
    assert refused.value.status == 400 and refused.value.param == "messages"


def test_a_chat_template_that_refuses_the_messages_is_a_400(served, tool_tokenizer):
    """A template's own `raise_exception` (roles it does not take, turns that do not alternate) was a plain-text
    500 (the `openai` client retried it)."""
    model = dataclasses.replace(served, tokenizer=tool_tokenizer)
    with serving(model) as url:
        status, _, text = post(url, "/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]})
    error = json.loads(text)["error"]
    assert status == 400 and error["param"] == "messages" and "no wizards" in error["message"]


def test_a_model_is_retrieved_by_its_id(served, base):
    """By its whole id (a Hub-style one holds a slash), behind the API key as `/v1/models` is."""
    status, _, text = request(base, "GET", f"/v1/models/{served.name}")
    assert status == 200 and json.loads(text)["id"] == served.name and json.loads(text)["object"] == "model"
    for other in ("other", served.name[:3]):
        status, _, text = request(base, "GET", f"/v1/models/{other}")
        assert status == 404 and json.loads(text)["error"]["param"] == "model"
    with serving(dataclasses.replace(served, name="org/model"), ServerLimits(api_key="k")) as url:
        assert request(url, "GET", "/v1/models/org/model")[0] == 401
        status, _, text = request(url, "GET", "/v1/models/org/model", headers={"Authorization": "Bearer k"})
        assert status == 200 and json.loads(text)["id"] == "org/model"


def test_a_chat_request_the_library_refuses_in_its_batch_names_messages(base):
    """A refusal made inside the batch (the prompt and budget beyond the model's positions) names the chat field,
    in the message and in `param` (the library calls it `input_ids`)."""
    status, _, text = post(base, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 5000})
    error = json.loads(text)["error"]
    assert status == 400 and error["param"] == "messages", text
    assert "`messages`" in error["message"] and "`prompt`" not in error["message"] and "input_ids" not in text


# -- several completions per request ---------------------------------------------------------------------------

def test_a_request_with_one_refused_prompt_is_refused_whole_and_frees_its_rows(base):
    """A list of prompts whose second one the library refuses in its batch (beyond the model's positions): a 400
    naming `prompt`, no partial answer, and nothing of it left running."""
    status, _, text = post(base, "/v1/completions", {"prompt": [PROMPT, [5] * 2100], "max_tokens": 1500,
                                                     "ignore_eos": True})
    error = json.loads(text)["error"]
    assert status == 400 and error["param"] == "prompt" and error["message"].startswith("`prompt[1]` ("), text
    deadline = time.monotonic() + 30
    while (health(base)["running"] or health(base)["queued"]) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert health(base)["running"] == health(base)["queued"] == 0        # the good row was cancelled, not decoded


def test_a_client_that_leaves_frees_every_row_of_its_request(served):
    """A streamed request of n=4 long completions whose client goes away after the first chunk: all four rows end
    (cancelled), not only the first."""
    app = create_app(served, ServerLimits())
    with serve_in_background(app) as url:
        before = len(app.state.batcher.history)
        with long_stream(url, n=4):
            pass
        deadline = time.monotonic() + 60
        while len(app.state.batcher.history) < before + 4 and time.monotonic() < deadline:
            time.sleep(0.05)
        rows = list(app.state.batcher.history)[before:]
        assert len(rows) == 4 and all(r["finish_reason"] == "cancelled" and r["tokens"] < 1500 for r in rows), rows
        assert health(url)["running"] == 0


def test_max_step_tokens_reads_the_longest_prompt_of_a_request(served):
    """`--max-step-tokens 20`: a list whose second prompt is longer than a forward may hold is refused naming it
    (only the first prompt was measured, and the batcher assumes a request that starts a batch fits)."""
    with serving(served, max_step_tokens=20) as url:
        status, _, text = post(url, "/v1/completions", {"prompt": [[5] * 4, [5] * 25], "max_tokens": 2})
        error = json.loads(text)["error"]
        assert status == 400 and error["param"] == "prompt" and error["message"].startswith("`prompt[1]`"), text


def test_a_stream_starts_while_one_of_its_completions_still_waits_for_a_row(served):
    """`--max-batch-size 1`, `n=2` streamed: the first completion's tokens arrive while the second waits for a free
    row (nothing was sent until every completion had started: the first had decoded all its tokens by then)."""
    with serving(served, max_batch_size=1) as url:
        conn = http.client.HTTPConnection(url.split("//")[1], timeout=60)
        conn.request("POST", "/v1/completions", json.dumps({"prompt": PROMPT, "max_tokens": 1500, "n": 2,
                                                            "ignore_eos": True, "stream": True}),
                     {"Content-Type": "application/json"})
        response = conn.getresponse()
        assert response.status == 200 and response.readline().startswith(b"data:")
        assert health(url)["queued"] == 1                     # the second completion still waits for its row
        conn.close()


def test_max_waiting_counts_every_completion_and_seeds_wrap(served):
    """`--max-waiting 3`, `--max-batch-size 1`, while a batch runs: more completions in one request than an idle
    server runs and queues (1 + 3) is a 400 naming `n` (it could never be admitted: a 429 told the client to retry
    forever); with 2 waiting, a request of 2 more gets 429. Completion 1 of `seed = 2**64 - 1` samples with seed 0
    (the seed wraps, as `manual_seed` takes no larger one)."""
    body = {"prompt": PROMPT, "max_tokens": 6, "temperature": 1.5, "ignore_eos": True}
    with serving(served, ServerLimits(max_waiting=3), max_batch_size=1) as url, \
            concurrent.futures.ThreadPoolExecutor(1) as pool:
        with long_stream(url):
            status, _, text = post(url, "/v1/completions", {**body, "n": 5})
            assert status == 400 and json.loads(text)["error"]["param"] == "n", text
            waiting = pool.submit(post, url, "/v1/completions", {**body, "n": 2, "seed": 2 ** 64 - 1})
            deadline = time.monotonic() + 30                 # sampled: other options than the stream, so it waits
            while health(url)["queued"] < 2 and time.monotonic() < deadline:
                time.sleep(0.02)
            status, headers, text = post(url, "/v1/completions", {**body, "n": 2})
            assert status == 429 and int(headers["retry-after"]) >= 1 and "2 requests waiting" in text, text
        status, _, text = waiting.result(timeout=120)        # the stream's client left: the waiting request runs
        assert status == 200, text
        wrapped = json.loads(text)["choices"][1]["text"]
        alone = json.loads(post(url, "/v1/completions", {**body, "seed": 0})[2])["choices"][0]["text"]
        assert wrapped == alone


def test_rows_cancelled_while_waiting_leave_the_queue_at_the_running_calls_join_points(served):
    """A client that leaves while its completions wait behind a running call of the same options: its rows were
    dropped only when the call ended, and counted as waiting meanwhile (`/health`, `--max-waiting`)."""
    app = create_app(dataclasses.replace(served, max_batch_size=1), ServerLimits())
    with serve_in_background(app) as url:
        with long_stream(url):
            conn = http.client.HTTPConnection(url.split("//")[1], timeout=30)
            conn.request("POST", "/v1/completions", json.dumps({"prompt": "#\n#\n", "max_tokens": 1500, "n": 3,
                                                                "ignore_eos": True, "stream": True}),
                         {"Content-Type": "application/json"})
            deadline = time.monotonic() + 30
            while health(url)["queued"] < 3 and time.monotonic() < deadline:
                time.sleep(0.02)
            assert health(url)["queued"] == 3
            conn.close()                                      # the client leaves; the stream still runs
            deadline = time.monotonic() + 30
            while health(url)["queued"] and time.monotonic() < deadline:
                time.sleep(0.05)
            assert health(url)["queued"] == 0 and health(url)["running"] == 1
            assert health(url)["cancelled"] == health(url)["cancelled"] == 3     # counted once, however often read


def test_budgets_and_library_refusals_in_the_servers_terms():
    from hf_dllm_spec.serving.protocol import RequestError, max_tokens_of, server_error
    from hf_dllm_spec.validation import invalid

    assert max_tokens_of({}, 16) == 16 and max_tokens_of({"max_completion_tokens": 2}, 16) == 2
    assert max_tokens_of({"max_tokens": 3, "max_completion_tokens": 2}, 16) == 2
    for body in ({"max_tokens": 0}, {"max_completion_tokens": 0}):
        with pytest.raises(RequestError) as refused:
            max_tokens_of(body, 16)
        assert refused.value.param == next(iter(body))
    assert server_error(invalid("sub_block_size", 3, "r", "f")).param == "sub_block_size"   # a strategy parameter
    assert server_error(invalid("mask_token_id", 1, "r", "f")).param is None                # not a request field
    assert server_error(invalid("input_ids", 1, "r", "f"), "messages").param == "messages"
    assert server_error(invalid("max_new_tokens", 1, "r", "f")).param == "max_tokens"


@pytest.mark.parametrize("error", [TypeError("unsupported operand"), ValueError("bad turn")])
def test_a_template_that_fails_with_another_error_is_a_400_too(error):
    from hf_dllm_spec.serving.protocol import RequestError, chat_prompt

    class Failing:
        def apply_chat_template(self, *args, **kwargs):
            raise error

    with pytest.raises(RequestError, match=str(error)) as refused:
        chat_prompt({"messages": CHAT}, Failing())
    assert refused.value.status == 400 and refused.value.param == "messages"


@pytest.mark.parametrize("body, param", [
    ({"stream_options": {"include_usage": True}}, "stream_options"),          # OpenAI: only with stream=true
    ({"stream": True, "stream_options": {"include_usage": "yes"}}, "stream_options"),
    ({"stream": True, "stream_options": "yes"}, "stream_options"),
    ({"max_tokens": "abc", "max_completion_tokens": 2}, "max_tokens"),       # was ignored beside the other
    ({"web_search_options": {}}, "web_search_options"),                       # its presence turns search on
    ({"prompt": "2 + 3?"}, "prompt"),                                          # a /v1/completions field
    ({"stream": True, "stream_options": {"include_usage": True, "foo": True}}, "stream_options"),
    ({"max_tokens": 0, "max_completion_tokens": 2}, "max_tokens"),
])
def test_chat_fields_the_openai_api_refuses_are_refused(base, body, param):
    status, _, text = post(base, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 2, **body})
    assert status == 400 and json.loads(text)["error"]["param"] == param, text


@pytest.mark.parametrize("body", [{"parallel_tool_calls": True}, {"modalities": ["text"]}, {"prompt": None},
                                  {"stream": True, "stream_options": {"include_usage": True}}])
def test_chat_fields_at_the_openai_default_are_served(base, body):
    assert post(base, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 2, **body})[0] == 200


def test_every_error_answer_is_openai_json(served):
    """A `Host` outside the allowed ones (Starlette's check; its answer was a plain-text 400) and a failure of the
    server itself (was a plain-text 500 with the exception's text) answer in the OpenAI error shape."""
    class Broken:
        chat_template = "x"

        def apply_chat_template(self, *args, **kwargs):
            raise RuntimeError("the tokenizer broke")

    with serving(served, ServerLimits(allowed_hosts=("localhost", "[::1]"))) as url:
        for host in ("evil.example", "[::1]evil.example", "localhost:80:80"):
            status, _, text = request(url, "GET", "/health", headers={"Host": host})
            assert status == 400 and json.loads(text)["error"]["param"] == "Host", host
        for host in ("[::1]:8000", "localhost", "LOCALHOST:1"):
            assert request(url, "GET", "/health", headers={"Host": host})[0] == 200, host
    with serving(dataclasses.replace(served, tokenizer=Broken())) as url:
        status, _, text = post(url, "/v1/chat/completions", {"messages": CHAT})
    error = json.loads(text)["error"]
    assert status == 500 and error["type"] == "server_error" and "RuntimeError" in error["message"]
    assert "the tokenizer broke" not in error["message"]                   # the exception's text stays in the log


@pytest.mark.parametrize("pattern", ["foo*", "*example.com", "", "a.*.com", "a*.com"])
def test_an_allowed_host_pattern_starlette_cannot_match_is_refused_at_start(pattern):
    """Starlette asserted on such a pattern (a bare AssertionError when the app was built)."""
    with pytest.raises(ValueError, match=r"`allowed_hosts`"):
        ServerLimits(allowed_hosts=("localhost", pattern))
