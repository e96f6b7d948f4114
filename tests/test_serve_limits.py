"""The server's security and limits (`hf_dllm_spec.serving.limits`), vLLM's extensions and bad values: raw HTTP
(the standard library, no client-side checks) and the stock `openai` client on 127.0.0.1.

Every case gets its status and a message naming the field, the rule and the fix; after each the server still
answers a good request with the tokens of batch-1 `model.generate` (greedy). Loops are bounded by deadlines.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import http.client
import json
import pathlib
import time

import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")

from hf_dllm_spec.serving.app import create_app, load_served_model, serve_in_background  # noqa: E402
from hf_dllm_spec.serving.limits import ServerLimits  # noqa: E402

MODELS = pathlib.Path(__file__).resolve().parents[1] / "models"
QUESTIONS = [json.loads(line)["question"] for line in (MODELS / "sdar-tiny-arith" / "heldout_arithmetic.jsonl")
             .read_text().splitlines()[:4]]
PROMPT = f"Question: {QUESTIONS[0]}\nAnswer:"
KEY = "sk-test-0123456789"
AUTH = {"Authorization": f"Bearer {KEY}"}
LIMITS = ServerLimits(api_key=KEY, max_body_bytes=64 * 1024, max_json_depth=16, max_prompt_tokens=200,
                      allowed_hosts=("127.0.0.1", "localhost"))   # the default body timeout (30 s): no false 408


@pytest.fixture(scope="module")
def served(one_thread):
    return load_served_model(str(MODELS / "sdar-tiny-arith"))


@pytest.fixture(scope="module")
def server(served):
    with serve_in_background(create_app(served, LIMITS)) as base:
        yield base


def reference(served, prompt: str, max_tokens: int, **kwargs) -> list[int]:
    ids = served.tokenizer(prompt, return_tensors="pt").input_ids
    out = served.model.generate(ids, decoding_strategy=served.default_strategy, max_new_tokens=max_tokens,
                                return_dict_in_generate=True, **kwargs)
    return out.sequences[0, ids.shape[1]:][: out.spec_stats_per_row[0].num_generated_tokens].tolist()


def request(base: str, method: str, path: str, body: bytes | str | None = None, headers: dict | None = None,
            timeout: float = 60) -> tuple[int, dict, str]:
    """(status, headers, body text) of one raw request."""
    conn = http.client.HTTPConnection(base.split("//")[1], timeout=timeout)
    try:
        conn.request(method, path, body, headers or {})
        response = conn.getresponse()
        return response.status, dict(response.getheaders()), response.read().decode()
    finally:
        conn.close()


def post(base: str, body, headers: dict | None = None, path: str = "/v1/completions") -> tuple[int, str]:
    raw = body if isinstance(body, (str, bytes)) else json.dumps(body)
    status, _, text = request(base, "POST", path, raw, {"Content-Type": "application/json", **AUTH,
                                                         **(headers or {})})
    return status, text


def still_serving(served, base: str) -> None:
    """A good request after a refused one: the tokens of `generate`."""
    client = openai.OpenAI(base_url=base + "/v1", api_key=KEY, timeout=60, max_retries=0)
    r = client.completions.create(model=served.name, prompt=PROMPT, max_tokens=6)
    assert r.choices[0].text == served.tokenizer.decode(reference(served, PROMPT, 6), skip_special_tokens=True)
    assert request(base, "GET", "/health")[0] == 200


def message(text: str) -> str:
    return json.loads(text)["error"]["message"]


# -- the API key ---------------------------------------------------------------------------------------------------

def test_api_key_is_required_on_every_route_but_health(served, server):
    good = json.dumps({"prompt": PROMPT, "max_tokens": 4})
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}, {"Authorization": "Basic x"}):
        for method, path, body in (("POST", "/v1/completions", good), ("POST", "/v1/chat/completions", good),
                                   ("GET", "/v1/models", None), ("GET", "/metrics", None)):
            status, head, text = request(server, method, path, body, {"Content-Type": "application/json", **headers})
            assert status == 401, (path, headers, text)
            assert head.get("www-authenticate") == "Bearer" and "API key" in message(text)
    assert request(server, "GET", "/health")[0] == 200
    for path in ("/docs", "/redoc", "/openapi.json"):                # FastAPI's pages, unkeyed: off with a key
        assert request(server, "GET", path, None, AUTH)[0] == 404, path
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server + "/v1", api_key="wrong", max_retries=0).models.list()
    assert [m.id for m in openai.OpenAI(base_url=server + "/v1", api_key=KEY, max_retries=0).models.list()] == \
        [served.name]
    still_serving(served, server)


def test_serve_reads_the_key_from_the_environment(monkeypatch):
    from hf_dllm_spec.cli import build_parser
    from hf_dllm_spec.serving.cli import server_limits

    parse = build_parser().parse_args
    monkeypatch.setenv("HF_DLLM_SPEC_API_KEY", "from-env")
    assert server_limits(parse(["serve", "m"])).api_key == "from-env"
    assert server_limits(parse(["serve", "m", "--api-key", "flag"])).api_key == "flag"
    monkeypatch.delenv("HF_DLLM_SPEC_API_KEY")
    limits = server_limits(parse(["serve", "m"]))
    assert limits.api_key is None and "127.0.0.1" in limits.allowed_hosts and "*" not in limits.allowed_hosts
    assert server_limits(parse(["serve", "m", "--host", "0.0.0.0"])).allowed_hosts == ("*",)
    limits = server_limits(parse(["serve", "m", "--max-body-bytes", "100", "--max-waiting", "3"]))
    assert (limits.max_body_bytes, limits.max_waiting) == (100, 3)
    for empty in ("", "  "):                      # `export HF_DLLM_SPEC_API_KEY=$UNSET`: no key at all
        monkeypatch.setenv("HF_DLLM_SPEC_API_KEY", empty)
        with pytest.raises(ValueError, match="argument HF_DLLM_SPEC_API_KEY: must not be empty"):
            server_limits(parse(["serve", "m"]))


def test_host_header_outside_the_allowed_hosts_is_refused(served, server):
    status, _, _ = request(server, "GET", "/health", headers={"Host": "attacker.example"})
    assert status == 400
    assert request(server, "GET", "/health", headers={"Host": "localhost:1234"})[0] == 200


# -- the body: type, size, arrival time, JSON -------------------------------------------------------------------

@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", None])
def test_only_json_bodies_are_read(served, server, content_type):
    headers = {**AUTH, **({"Content-Type": content_type} if content_type else {})}
    status, _, text = request(server, "POST", "/v1/completions", json.dumps({"prompt": PROMPT}), headers)
    assert status == 415 and "must be application/json" in message(text)
    assert post(server, {"prompt": PROMPT, "max_tokens": 2}, {"Content-Type": "application/json; charset=utf-8"})[0] \
        == 200
    still_serving(served, server)


def test_a_declared_body_over_the_limit_gets_413_before_it_is_sent(served, server):
    """Only the headers are sent (Content-Length 1 GB): the answer comes without the server waiting for a byte."""
    conn = http.client.HTTPConnection(server.split("//")[1], timeout=10)
    try:
        conn.putrequest("POST", "/v1/completions")
        for name, value in {"Content-Type": "application/json", "Content-Length": str(10 ** 9), **AUTH}.items():
            conn.putheader(name, value)
        conn.endheaders()
        response = conn.getresponse()
        text = response.read().decode()
    finally:
        conn.close()
    assert response.status == 413 and "at most 65536 bytes" in message(text) and len(text) < 600
    still_serving(served, server)


def test_a_chunked_body_over_the_limit_gets_413_and_is_not_echoed(served, server):
    def chunks():
        yield b'{"prompt": "'
        for _ in range(200):                       # 200 x 1 KiB, over the 64 KiB limit
            yield b"a" * 1024
        yield b'"}'

    conn = http.client.HTTPConnection(server.split("//")[1], timeout=10)
    try:
        conn.request("POST", "/v1/completions", chunks(), {"Content-Type": "application/json", **AUTH},
                     encode_chunked=True)
        response = conn.getresponse()
        status, text = response.status, response.read().decode()
    except (BrokenPipeError, ConnectionResetError):      # the server answered and closed while we were sending
        status, text = 413, '{"error": {"message": "at most 65536 bytes"}}'
    finally:
        conn.close()
    assert status == 413 and "at most 65536 bytes" in message(text) and len(text) < 600
    still_serving(served, server)


def test_a_slow_body_gets_408(served):
    """A server of its own with a short body timeout: the shared one keeps the default, so that a loaded machine
    never turns another test's body into a 408."""
    with serve_in_background(create_app(served, dataclasses.replace(LIMITS, body_timeout_s=1.5))) as server:
        _a_slow_body_gets_408(served, server)


def _a_slow_body_gets_408(served, server: str) -> None:
    conn = http.client.HTTPConnection(server.split("//")[1], timeout=10)
    t0 = time.monotonic()
    try:
        conn.putrequest("POST", "/v1/completions")
        for name, value in {"Content-Type": "application/json", "Content-Length": "100", **AUTH}.items():
            conn.putheader(name, value)
        conn.endheaders()
        conn.send(b'{"prompt": ')                 # then nothing: the client stalls
        response = conn.getresponse()
        text = response.read().decode()
    finally:
        conn.close()
    assert response.status == 408 and "arrive within 1.5 s" in message(text)
    assert time.monotonic() - t0 < 8
    still_serving(served, server)


BAD_BODIES = [
    pytest.param('{"prompt": "a", "temperature": NaN}', "RFC 8259", id="nan-literal"),
    pytest.param('{"prompt": "a", "temperature": Infinity}', "RFC 8259", id="infinity-literal"),
    pytest.param('{"prompt": "a", "temperature": 1e400}', "`temperature` (=inf) must be a finite number",
                 id="overflowing-float"),
    pytest.param("[" * 10000 + "]" * 10000, "nested deeper than 16", id="deep-nesting"),
    pytest.param('{"prompt": "a", "x": ' + "[" * 17 + "]" * 17 + "}", "nested deeper than 16", id="depth-17"),
    pytest.param('{"prompt": "a", ', "not JSON", id="truncated"),
    pytest.param('["prompt"]', "`body` (='list') must be a JSON object", id="not-an-object"),
    pytest.param('{"prompt": [9223372036854775808]}', "`prompt[0]` (=9223372036854775808) must be a 64-bit integer",
                 id="token-id-beyond-int64"),
    pytest.param('{"prompt": "a", "block_size": 1180591620717411303424}', "`block_size` (=1180591620717411303424)",
                 id="parameter-beyond-int64"),
]


@pytest.mark.parametrize("raw, expected", BAD_BODIES)
def test_bad_json_gets_400_naming_the_problem(served, server, raw, expected):
    status, text = post(server, raw)
    assert status == 400 and expected in message(text), text
    assert len(text) < 1200
    still_serving(served, server)


def test_an_error_quotes_only_an_excerpt_of_a_big_input(served, server):
    for body in ({"prompt": PROMPT, "model": "m" * 60000}, {"prompt": PROMPT, "block_size": "b" * 60000},
                 {"prompt": [["x"] * 6000]}, {"prompt": PROMPT, "stop": ["s" * 60000]}):
        status, text = post(server, body)
        assert status in (400, 404) and len(text) < 1200, text[:200]
    still_serving(served, server)


# -- bad values -------------------------------------------------------------------------------------------------

BAD_VALUES = [
    pytest.param({"temperature": -0.5}, "`temperature` (=-0.5) must lie in [0, 3.4e+38]", id="temperature-negative"),
    # beyond float32: -inf / inf is NaN, which failed the whole batch with a 500
    pytest.param({"temperature": 1e308}, "`temperature` (=1e+308) must lie in [0, 3.4e+38]", id="temperature-huge"),
    # only the neutral value of an unimplemented field passes (0 and 1 were taken as neutral for every field)
    pytest.param({"frequency_penalty": 1}, "`frequency_penalty` (=1) must be left unset", id="penalty-1"),
    pytest.param({"echo": 1}, "`echo` (=1) must be left unset", id="echo-1"),
    pytest.param({"best_of": 0}, "`best_of` (=0) must be left unset", id="best-of-0"),
    pytest.param({"temperature": "hot"}, "`temperature` (='hot') must be a number", id="temperature-string"),
    pytest.param({"top_p": 2}, "`top_p` (=2) must lie in (0, 1]", id="top-p-2"),
    pytest.param({"top_p": 0}, "`top_p` (=0) must lie in (0, 1]", id="top-p-0"),
    pytest.param({"top_k": -1}, "`top_k` (=-1) must be an integer in [0,", id="top-k-negative"),
    pytest.param({"seed": -1}, "`seed` (=-1) must be an unsigned 64-bit integer", id="seed-negative"),
    pytest.param({"seed": 2 ** 70}, "`seed` (=1180591620717411303424) must be an unsigned 64-bit", id="seed-2^70"),
    pytest.param({"logprobs": 0}, "`logprobs` (=0) must be left unset", id="logprobs-0"),
    pytest.param({"logprobs": 1}, "`logprobs` (=1) must be left unset", id="logprobs-1"),
    pytest.param({"logprobs": 5}, "`logprobs` (=5) must be left unset", id="logprobs-5"),
    pytest.param({"n": 129}, "`n` (=129) must be an integer in [1, 128]", id="n-129"),
    pytest.param({"n": True}, "`n` (=True) must be an integer in [1, 128]", id="n-true"),
    pytest.param({"n": 2.0}, "`n` (=2.0) must be an integer in [1, 128]", id="n-float"),
    pytest.param({"prompt": [PROMPT] * 65, "n": 2}, "`prompt` (='<65 prompts>') must ask for at most 128 completions "
                 "with n=2 (130 asked)", id="too-many-completions"),
    pytest.param({"prompt": [PROMPT, ""]}, "`prompt[1]` (='') must be a non-empty string", id="empty-second-prompt"),
    pytest.param({"prompt": [[5], [9999]]}, "`prompt[1][0]` (=9999) must be a token id in [0, 8192)",
                 id="token-out-of-vocab-second-prompt"),
    pytest.param({"prompt": [PROMPT, [5] * 300]}, "`prompt[1]` (='<prompt of 300 tokens>') must be at most 200 "
                 "tokens", id="second-prompt-too-long"),
    pytest.param({"prompt": [PROMPT, 5]}, "`prompt[1]` (=5) must be a non-empty string", id="prompt-list-of-mixed"),
    pytest.param({"prompt": [PROMPT, None]}, "`prompt[1]` (=None) must be a non-empty string", id="prompt-list-null"),
    pytest.param({"prompt": []}, "`prompt` (=[]) must be a non-empty string", id="prompt-empty-list"),
    pytest.param({"prompt": [9999]}, "`prompt[0]` (=9999) must be a token id in [0, 8192)", id="token-out-of-vocab"),
    pytest.param({"prompt": [-1]}, "`prompt[0]` (=-1) must be a token id", id="token-negative"),
    pytest.param({"prompt": [5] * 300}, "must be at most 200 tokens (the server's --max-prompt-tokens)",
                 id="prompt-too-long"),
    pytest.param({"decoding_strategy": "simsd"}, "restart the server with `hf-dllm-spec serve MODEL --draft-model "
                 "PATH`", id="no-drafter"),
    pytest.param({"decoding_strategy": 3}, "`decoding_strategy` (=3) must be a strategy name", id="strategy-type"),
    pytest.param({"min_tokens": 2}, "`min_tokens` (=2) must be 0 unless ignore_eos=true", id="min-tokens"),
    pytest.param({"min_tokens": 9, "ignore_eos": True}, "`min_tokens` (=9) must be an integer in [0, 4]",
                 id="min-tokens-over-max-tokens"),
    pytest.param({"ignore_eos": "yes"}, "`ignore_eos` (='yes') must be a bool", id="ignore-eos-type"),
    pytest.param({"max_tokens": 10 ** 6}, "max_tokens=1000000", id="budget-beyond-context"),
]


@pytest.mark.parametrize("change, expected", BAD_VALUES)
def test_bad_values_get_400_naming_field_rule_and_fix(served, server, change, expected):
    body = {"model": served.name, "prompt": PROMPT, "max_tokens": 4, **change}
    for stream in (False, True):
        status, text = post(server, {**body, "stream": stream})
        assert status == 400, text
        assert expected in message(text), message(text)
        assert "max_new_tokens" not in message(text) and "draft_model=" not in message(text)
    still_serving(served, server)


def test_chat_logprobs_are_refused_for_every_value_but_false(served, server):
    base = {"messages": [{"role": "user", "content": QUESTIONS[1]}], "max_tokens": 3}
    for value in (True, 1):
        status, text = post(server, {**base, "logprobs": value}, path="/v1/chat/completions")
        assert status == 400 and "`logprobs`" in message(text)
    assert post(server, {**base, "logprobs": False}, path="/v1/chat/completions")[0] == 200
    status, text = post(server, {**base, "messages": [{"role": "user", "content": 5}]}, path="/v1/chat/completions")
    assert status == 400 and "`messages[0].content` (=5)" in message(text)
    parts = [{"role": "user", "content": [{"type": "text", "text": 5}]}]          # was a 500 (a TypeError)
    status, text = post(server, {**base, "messages": parts}, path="/v1/chat/completions")
    assert status == 400 and "`messages[0].content[0]`" in message(text)


def test_neutral_values_are_served_and_a_tiny_temperature_is_greedy(served, server):
    """The neutral value of an unimplemented field (penalties 0.0, a text `response_format`) is served; a
    `temperature` below 1e-5 decodes greedily (vLLM's rule; 1e-300 overflowed the logits and failed with a 500)."""
    client = openai.OpenAI(base_url=server + "/v1", api_key=KEY, timeout=60, max_retries=0)
    messages = [{"role": "user", "content": QUESTIONS[1]}]
    greedy = client.chat.completions.create(model=served.name, messages=messages, max_tokens=6)
    for temperature in (1e-300, 1e-9):
        r = client.chat.completions.create(model=served.name, messages=messages, max_tokens=6, temperature=temperature,
                                           frequency_penalty=0.0, presence_penalty=0.0,
                                           response_format={"type": "text"})
        assert r.choices[0].message.content == greedy.choices[0].message.content


# -- vLLM's extensions --------------------------------------------------------------------------------------------

def test_ignore_eos_decodes_to_the_budget_as_generate_does(served, server):
    """A prompt that stops early decodes its whole budget with `ignore_eos` (the tokens of `generate(
    eos_token_id=None)`), with `usage` counting them; `min_tokens` with it is honoured."""
    budget = 40
    stopped = reference(served, PROMPT, budget)
    assert len(stopped) < budget                       # the model stops on its own here
    want = reference(served, PROMPT, budget, eos_token_id=None)
    assert len(want) == budget and want[: len(stopped)] == stopped
    client = openai.OpenAI(base_url=server + "/v1", api_key=KEY, timeout=60, max_retries=0)
    r = client.completions.create(model=served.name, prompt=PROMPT, max_tokens=budget,
                                  extra_body={"ignore_eos": True, "min_tokens": budget})
    assert r.choices[0].text == served.tokenizer.decode(want, skip_special_tokens=True)
    assert r.choices[0].finish_reason == "length"
    prompt_tokens = len(served.tokenizer(PROMPT)["input_ids"])
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == \
        (prompt_tokens, budget, prompt_tokens + budget)
    text, last = "", None
    for chunk in client.completions.create(model=served.name, prompt=PROMPT, max_tokens=budget, stream=True,
                                           extra_body={"ignore_eos": True}):
        text += chunk.choices[0].text if chunk.choices else ""
        last = chunk
    assert text == r.choices[0].text and last.usage.completion_tokens == budget
    r = client.completions.create(model=served.name, prompt=PROMPT, max_tokens=budget)
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == len(stopped)


def test_seeded_sampling_with_ignore_eos_equals_generate(served, server):
    client = openai.OpenAI(base_url=server + "/v1", api_key=KEY, timeout=60, max_retries=0)
    r = client.completions.create(model=served.name, prompt=PROMPT, max_tokens=12, temperature=0.8, top_p=0.9,
                                  seed=2 ** 64 - 1, extra_body={"ignore_eos": True})
    want = reference(served, PROMPT, 12, eos_token_id=None, do_sample=True, temperature=0.8, top_p=0.9,
                     generator=[torch.Generator().manual_seed(2 ** 64 - 1)])
    assert r.choices[0].text == served.tokenizer.decode(want, skip_special_tokens=True)


# -- waiting requests -------------------------------------------------------------------------------------------

@contextlib.contextmanager
def long_stream(base: str, headers: dict | None = None, **extra):
    """A streamed `ignore_eos` request of 1,500 tokens (`extra`: other body fields, or another prompt), running once
    its first chunk arrived; closed at the end (its client goes away: the server cancels it). Yields the response."""
    conn = http.client.HTTPConnection(base.split("//")[1], timeout=60)
    body = {"prompt": "#\n#\n", "max_tokens": 1500, "stream": True, "ignore_eos": True, **extra}
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json", **(headers or {})})
    response = conn.getresponse()
    assert response.status == 200 and response.readline().startswith(b"data:")
    try:
        yield response
    finally:
        conn.close()


def test_past_max_waiting_requests_get_429_with_retry_after(served):
    """`max_waiting=0`: while a batch runs, a new request gets 429 with `Retry-After`; once it ends (its client
    went away), requests are served again."""
    with serve_in_background(create_app(served, ServerLimits(api_key=KEY, max_waiting=0))) as base:
        with long_stream(base, AUTH, model=served.name):
            status, headers, text = request(base, "POST", "/v1/completions",
                                            json.dumps({"prompt": PROMPT, "max_tokens": 2}),
                                            {"Content-Type": "application/json", **AUTH})
            assert status == 429 and "--max-waiting" in message(text) and int(headers["retry-after"]) >= 1
            assert json.loads(text)["error"]["type"] == "rate_limit_error"          # OpenAI's type for a 429
        deadline = time.monotonic() + 30
        while json.loads(request(base, "GET", "/health")[2])["running"] and time.monotonic() < deadline:
            time.sleep(0.05)
        still_serving(served, base)


# -- metrics ----------------------------------------------------------------------------------------------------

def _samples(text: str) -> dict[str, float]:
    """`name{labels}` -> value of a Prometheus text exposition (comments skipped)."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def test_metrics_count_requests_tokens_and_the_library_statistics(served):
    """`/metrics` (behind the key) in Prometheus text: after known requests, the counters hold their tokens,
    the time-to-first-token histogram their count, tokens per forward the library's NFE."""
    pytest.importorskip("prometheus_client")
    from prometheus_client.parser import text_string_to_metric_families

    with serve_in_background(create_app(served, ServerLimits(api_key=KEY))) as base:
        client = openai.OpenAI(base_url=base + "/v1", api_key=KEY, timeout=60, max_retries=0)
        rows = [client.completions.create(model=served.name, prompt=f"Question: {q}\nAnswer:", max_tokens=8)
                for q in QUESTIONS[:3]]
        rows.append(client.completions.create(model=served.name, prompt=PROMPT, max_tokens=8,
                                              extra_body={"decoding_strategy": "s2d2"}))
        deadline = time.monotonic() + 30                  # the worker leaves the batch just after its last event
        while json.loads(request(base, "GET", "/health")[2])["running"] and time.monotonic() < deadline:
            time.sleep(0.02)
        status, head, text = request(base, "GET", "/metrics", headers=AUTH)
    assert status == 200 and head["content-type"].startswith("text/plain")
    list(text_string_to_metric_families(text))                      # parses as Prometheus text
    got = _samples(text)
    strategy = served.default_strategy
    tokens = sum(r.usage.completion_tokens for r in rows[:3])
    assert got[f'hf_dllm_spec_generation_tokens_total{{strategy="{strategy}"}}'] == tokens
    assert got[f'hf_dllm_spec_prompt_tokens_total{{strategy="{strategy}"}}'] == \
        sum(r.usage.prompt_tokens for r in rows[:3])
    assert got[f'hf_dllm_spec_time_to_first_token_seconds_count{{strategy="{strategy}"}}'] == 3
    assert got['hf_dllm_spec_time_to_first_token_seconds_count{strategy="s2d2"}'] == 1
    nfe = sum(r.model_extra["dllm_stats"]["nfe"] for r in rows[:3])
    assert got[f'hf_dllm_spec_forwards_total{{strategy="{strategy}"}}'] == nfe
    assert got[f'hf_dllm_spec_tokens_per_forward{{strategy="{strategy}"}}'] == pytest.approx(tokens / nfe)
    s2d2 = rows[3].model_extra["dllm_stats"]
    assert got['hf_dllm_spec_draft_tokens_total{strategy="s2d2"}'] == s2d2["num_draft_tokens"]
    if s2d2["num_draft_tokens"]:
        assert got['hf_dllm_spec_acceptance_rate{strategy="s2d2"}'] == pytest.approx(s2d2["acceptance_rate"])
    finished = sum(v for k, v in got.items() if k.startswith("hf_dllm_spec_requests_total{"))
    assert finished == 4
    assert got["hf_dllm_spec_requests_running"] == 0 and got["hf_dllm_spec_requests_waiting"] == 0
    assert got["hf_dllm_spec_generation_tokens_per_second"] > 0


# -- concurrent batches -----------------------------------------------------------------------------------------

def test_a_short_request_does_not_wait_for_a_long_batch_with_two_workers(served):
    """`max_concurrent_batches=2`: while a 1,500-token `ignore_eos` stream decodes, a short request starts in the
    free worker, ends long before the stream, and gets the tokens of `generate`; concurrent requests of two
    groups (greedy and seeded sampling) each get their batch-1 tokens."""
    import concurrent.futures
    import dataclasses

    two = dataclasses.replace(served, max_concurrent_batches=2)
    with serve_in_background(create_app(two, ServerLimits(api_key=KEY))) as base:
        client = openai.OpenAI(base_url=base + "/v1", api_key=KEY, timeout=60, max_retries=0)
        with long_stream(base, AUTH, model=served.name):
            t0 = time.monotonic()
            r = client.completions.create(model=served.name, prompt=PROMPT, max_tokens=8)
            short = time.monotonic() - t0
            deadline = time.monotonic() + 20                       # the short batch's worker may still be
            health = json.loads(request(base, "GET", "/health")[2])  # closing its batch when the answer arrives
            while health["running"] != 1 and time.monotonic() < deadline:
                time.sleep(0.05)
                health = json.loads(request(base, "GET", "/health")[2])
            assert health["running"] == 1, health                # the long stream still decodes
        assert r.choices[0].text == served.tokenizer.decode(reference(served, PROMPT, 8), skip_special_tokens=True)
        assert short < 30

        prompts = [f"Question: {q}\nAnswer:" for q in QUESTIONS]

        def ask(i):
            sampled = {"temperature": 0.9, "seed": 7 + i} if i % 2 else {}
            return client.completions.create(model=served.name, prompt=prompts[i], max_tokens=8,
                                             **sampled).choices[0].text

        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            texts = list(pool.map(ask, range(4)))
        for i, text in enumerate(texts):
            sampled = dict(do_sample=True, temperature=0.9, generator=[torch.Generator().manual_seed(7 + i)]) \
                if i % 2 else {}
            assert text == served.tokenizer.decode(reference(served, prompts[i], 8, **sampled),
                                                   skip_special_tokens=True), i


def test_two_workers_are_refused_with_the_static_runtime(served):
    from hf_dllm_spec.serving.batcher import Batcher

    served.model.generation_config.cache_implementation = "static"
    try:
        with pytest.raises(ValueError, match=r"`workers` \(=2\) must be 1 with cache_implementation='static'"):
            Batcher(served.model, workers=2)
    finally:
        served.model.generation_config.cache_implementation = None


def test_max_step_tokens_bounds_each_batch_and_refuses_a_longer_prompt(served):
    """`max_step_tokens` = 2 prompts: six concurrent requests of one length run in batches of at most 2 rows, each
    with its batch-1 tokens; a prompt longer than the limit gets 400 naming the flag."""
    import concurrent.futures
    import dataclasses

    prompts = [f"Question: {q}\nAnswer:" for q in QUESTIONS]
    width = max(len(served.tokenizer(p)["input_ids"]) for p in prompts)
    bounded = dataclasses.replace(served, max_step_tokens=2 * width)
    app = create_app(bounded, ServerLimits(api_key=KEY))
    with serve_in_background(app) as base:
        client = openai.OpenAI(base_url=base + "/v1", api_key=KEY, timeout=60, max_retries=0)
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            texts = list(pool.map(lambda p: client.completions.create(model=served.name, prompt=p,
                                                                      max_tokens=6).choices[0].text, prompts * 2))
        assert max(row["batch_size"] for row in app.state.batcher.history) <= 2
        for prompt, text in zip(prompts * 2, texts):
            assert text == served.tokenizer.decode(reference(served, prompt, 6), skip_special_tokens=True)
        status, text = post(base, {"prompt": [5] * (2 * width + 1), "max_tokens": 2})
        assert status == 400 and "the server's --max-step-tokens" in message(text)
        still_serving(served, base)


# -- shutdown ---------------------------------------------------------------------------------------------------

def test_completions_up_to_the_limit_are_accepted_and_stream_drafts_takes_one(served):
    """128 completions in all are one request's most (n=128, or 64 prompts with n=2); `stream_drafts` is refused
    with more than one completion (its stream is batch 1)."""
    from hf_dllm_spec.serving.protocol import RequestError, parse_request

    def parse(body):
        return parse_request(body, chat=False, tokenizer=served.tokenizer, served_name=served.name,
                             default_strategy=served.default_strategy, default_params={},
                             generation_config=served.model.generation_config, default_max_tokens=4)

    assert len(parse({"prompt": PROMPT, "n": 128})) == len(parse({"prompt": [PROMPT] * 64, "n": 2})) == 128
    for body in ({"prompt": PROMPT, "n": 2}, {"prompt": [PROMPT, PROMPT]}):
        with pytest.raises(RequestError, match=r"`stream_drafts` \(=True\) must ask for one completion"):
            parse({**body, "stream": True, "stream_drafts": True})
    assert len(parse({"prompt": [PROMPT], "stream": True, "stream_drafts": True})) == 1


def test_too_many_prompts_are_refused_before_any_is_tokenized(served, monkeypatch):
    """A body of 200,000 one-character prompts (under the body limit) was tokenized whole, on the one parsing
    thread (14 s for a million), before the count was refused."""
    from hf_dllm_spec.serving.protocol import RequestError, parse_request

    calls = []
    monkeypatch.setattr(served.tokenizer.__class__, "__call__", lambda self, *a, **k: calls.append(1))
    with pytest.raises(RequestError, match=r"`prompt` \(='<200000 prompts>'\) must ask for at most 128"):
        parse_request({"prompt": ["x"] * 200_000}, chat=False, tokenizer=served.tokenizer, served_name=served.name,
                      default_strategy=served.default_strategy, default_params={},
                      generation_config=served.model.generation_config, default_max_tokens=4)
    assert not calls


def test_requests_waiting_at_close_and_submitted_after_it_get_503(served):
    """`Batcher.close` (the server's shutdown) answers the requests still waiting with a 503 error event, and any
    request submitted afterwards at once; the batch in progress finishes with its tokens."""
    from hf_dllm_spec.serving.batcher import Batcher, Job
    from hf_dllm_spec.serving.protocol import parse_request

    def parsed(body: dict):
        (row,) = parse_request(body, chat=False, tokenizer=served.tokenizer, served_name=served.name,
                               default_strategy=served.default_strategy, default_params=served.default_params,
                               generation_config=served.model.generation_config,
                               default_max_tokens=served.default_max_tokens)
        return row

    async def scenario():
        loop = asyncio.get_running_loop()
        batcher = Batcher(served.model)
        running = Job(parsed({"prompt": PROMPT, "max_tokens": 48, "ignore_eos": True}), loop)
        batcher.submit(running)
        first = await asyncio.wait_for(running.events.get(), 60)     # the batch runs (its first final tokens)
        waiting = Job(parsed({"prompt": PROMPT, "max_tokens": 2, "temperature": 0.5, "seed": 1}), loop)
        batcher.submit(waiting)                                       # other options: waits for the batch
        await asyncio.to_thread(batcher.close, 60)
        late = Job(parsed({"prompt": PROMPT, "max_tokens": 2}), loop)
        batcher.submit(late)
        events = [first]
        while events[-1][0] == "tokens":
            events.append(await asyncio.wait_for(running.events.get(), 60))
        return (events, await asyncio.wait_for(waiting.events.get(), 5),
                await asyncio.wait_for(late.events.get(), 5))

    events, waiting, late = asyncio.run(scenario())
    assert events[-1][0] == "done" and events[-1][1].finish_reason == "length"
    streamed = [t for _, payload in events[:-1] for t in payload]
    assert streamed == events[-1][1].tokens == reference(served, PROMPT, 48, eos_token_id=None)
    for kind, payload in (waiting, late):
        assert kind == "error" and payload[0] == 503 and "shutting down" in payload[1]


# -- the queue's order ------------------------------------------------------------------------------------------

def _parsed(served, body: dict):
    from hf_dllm_spec.serving.protocol import parse_request

    (row,) = parse_request(body, chat=False, tokenizer=served.tokenizer, served_name=served.name,
                           default_strategy=served.default_strategy, default_params=served.default_params,
                           generation_config=served.model.generation_config,
                           default_max_tokens=served.default_max_tokens)
    return row


async def _outcome(job, timeout: float = 120):
    """The job's tokens and its last event ("done" with the `Result`, or "error" with `(status, message)`)."""
    tokens = []
    while True:
        kind, payload = await asyncio.wait_for(job.events.get(), timeout)
        if kind != "tokens":
            return tokens, (kind, payload)
        tokens += payload


def test_a_refused_request_does_not_split_the_good_ones_of_its_batch(served):
    """A batch the library refuses (one request's budget beyond the context) is not re-run one request at a time:
    the bad request gets its 400 and the good ones of the same options still decode as one batch, each with the
    tokens of its own `generate` call (they decoded one after another, batch size 1)."""
    from hf_dllm_spec.serving.batcher import Batcher, Job

    prompts = [f"Question: {q}\nAnswer:" for q in QUESTIONS]

    async def scenario():
        loop = asyncio.get_running_loop()
        batcher = Batcher(served.model)
        try:
            holder = Job(_parsed(served, {"prompt": PROMPT, "max_tokens": 48, "temperature": 0.5, "seed": 1}), loop)
            batcher.submit(holder)                            # other options: the queued batch waits for it
            await asyncio.wait_for(holder.events.get(), 60)
            bad = Job(_parsed(served, {"prompt": PROMPT, "max_tokens": 5000}), loop)
            good = [Job(_parsed(served, {"prompt": p, "max_tokens": 6}), loop) for p in prompts]
            for job in (bad, *good):
                batcher.submit(job)
            outcomes = [await _outcome(job) for job in (bad, *good)]
            await _outcome(holder)
            return outcomes, {row["id"]: row for row in batcher.history}, [job.id for job in good]
        finally:
            await asyncio.to_thread(batcher.close, 60)

    outcomes, history, ids = asyncio.run(scenario())
    (_, (kind, (status, text, param))), *good = outcomes
    assert kind == "error" and status == 400 and "max_tokens" in text and param == "prompt"
    assert [history[i]["batch_size"] for i in ids] == [len(ids)] * len(ids)
    for prompt, (tokens, (kind, result)) in zip(prompts, good):
        assert kind == "done" and tokens == result.tokens == reference(served, prompt, 6)


def test_a_waiting_request_that_does_not_fit_is_not_passed_over_by_younger_ones(served):
    """With `max_step_tokens`, the oldest waiting request (a long prompt that does not fit beside the running rows)
    is not passed over by younger requests of the same options that would fit: the running call takes no more rows
    and drains, then the oldest runs (before, the younger ones kept joining it and the oldest waited)."""
    from hf_dllm_spec.serving.batcher import Batcher, Job

    async def scenario():
        loop = asyncio.get_running_loop()
        batcher = Batcher(served.model, max_step_tokens=200)
        try:
            running = Job(_parsed(served, {"prompt": PROMPT, "max_tokens": 160, "ignore_eos": True}), loop)
            batcher.submit(running)
            await asyncio.wait_for(running.events.get(), 60)
            oldest = Job(_parsed(served, {"prompt": [5] * 150, "max_tokens": 4, "ignore_eos": True}), loop)
            younger = [Job(_parsed(served, {"prompt": PROMPT, "max_tokens": 4, "ignore_eos": True}), loop)
                       for _ in range(3)]
            for job in (oldest, *younger):
                batcher.submit(job)
            for job in (running, oldest, *younger):
                await _outcome(job)
            return [row["id"] for row in batcher.history], oldest.id, [job.id for job in younger]
        finally:
            await asyncio.to_thread(batcher.close, 60)

    order, oldest, younger = asyncio.run(scenario())
    assert all(order.index(oldest) < order.index(i) for i in younger), order
