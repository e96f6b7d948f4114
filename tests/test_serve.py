"""The OpenAI-compatible server (`hf_dllm_spec.serving`): the stock `openai` client against `model.generate`.

Each server runs in-process (uvicorn in a thread) on 127.0.0.1 at a free port, one per bundled model and module,
and is stopped at the end. Tokens are compared with batch-1 `model.generate` calls of the same strategy,
parameters and budget (greedy).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import http.client
import json
import pathlib
import time

import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")

from hf_dllm_spec.integration.generate import dllm_generate  # noqa: E402
from hf_dllm_spec.integration.mixin import DllmGenerationMixin  # noqa: E402
from hf_dllm_spec.strategies.registry import get_strategy  # noqa: E402
from hf_dllm_spec.runtime.static import STATE_ATTRIBUTE  # noqa: E402
from hf_dllm_spec.serving.app import TextDeltas, create_app, load_served_model, serve_in_background  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

MODELS = pathlib.Path(__file__).resolve().parents[1] / "models"
QUESTIONS = [json.loads(line)["question"] for line in (MODELS / "sdar-tiny-arith" / "heldout_arithmetic.jsonl")
             .read_text().splitlines()[:16]]


@contextlib.contextmanager
def running(served):
    """Serve `served` on a free port of 127.0.0.1; yield `(openai client, base url, app)`; stop the server."""
    app = create_app(served)
    with serve_in_background(app) as base:
        yield openai.OpenAI(base_url=base + "/v1", api_key="unused", timeout=60, max_retries=0), base, app


def post(base: str, path: str, body: dict) -> tuple[int, str]:
    """(status, body) of a JSON POST, with the standard library (no client-side checks)."""
    conn = http.client.HTTPConnection(base.split("//")[1], timeout=60)
    try:
        conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        response = conn.getresponse()
        return response.status, response.read().decode()
    finally:
        conn.close()


def health(base: str) -> dict:
    conn = http.client.HTTPConnection(base.split("//")[1], timeout=10)
    try:
        conn.request("GET", "/health")
        return json.loads(conn.getresponse().read())
    finally:
        conn.close()


def reference(served, prompt_ids: list[int], max_tokens: int, strategy: str, **params) -> list[int]:
    """Batch-1 `model.generate` tokens (what the server must return)."""
    entry = {} if isinstance(served.model, DllmGenerationMixin) else {"custom_generate": dllm_generate}
    if get_strategy(strategy).uses_drafter:
        params["draft_model"] = served.drafter
    out = served.model.generate(torch.tensor([prompt_ids]), decoding_strategy=strategy, max_new_tokens=max_tokens,
                                return_dict_in_generate=True, **entry, **params)
    return out.sequences[0, len(prompt_ids):][: out.spec_stats_per_row[0].num_generated_tokens].tolist()


#: A sampled request's top-k and top-p where neither it nor the model's generation config sets them (none of the
#: bundled models does): no top-k, top-p 1 (not transformers' fallback top-k of 50).
NEUTRAL = dict(top_k=0, top_p=1.0)

# (model, drafter, strategies); the first strategy is the server's default
FAMILIES = [
    pytest.param(("sdar-tiny-arith", None, ("block_diffusion", "s2d2")), id="sdar"),
    pytest.param(("fast-dllm-v2-tiny", None, ("fast_dllm_v2",)), id="fast-dllm-v2"),
    pytest.param(("llada2-tiny", None, ("llada2",)), id="llada2"),
    pytest.param(("qwen2-tiny-ar", "deer-drafter-tiny", ("deer", "ar")), id="qwen2-deer"),
    pytest.param(("sdar-large", "sdar-tiny-arith", ("simsd",)), id="sdar-large-simsd", marks=pytest.mark.slow),
]


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, one_thread):
    name, drafter, strategies = request.param
    served = load_served_model(str(MODELS / name), draft_model=str(MODELS / drafter) if drafter else None,
                               strategy=strategies[0])
    with running(served) as (client, base, app):
        yield served, client, strategies


def _stream_text(stream) -> tuple[str, object]:
    text, last = "", None
    for chunk in stream:
        if chunk.choices:
            choice = chunk.choices[0]
            text += (choice.delta.content or "") if hasattr(choice, "delta") else choice.text
        last = chunk
    return text, last


def test_openai_client_gets_the_tokens_of_generate(family):
    """Completions and chat, streamed and not, for each strategy: the text of the batch-1 `generate` tokens, the
    token count in `usage`, the library's statistics in `dllm_stats`."""
    served, client, strategies = family
    tok = served.tokenizer
    question = QUESTIONS[0]
    prompt = f"Question: {question}\nAnswer:"
    chat_ids = tok(tok.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                           add_generation_prompt=True), add_special_tokens=False)["input_ids"]
    for strategy in strategies:
        extra = {"decoding_strategy": strategy}
        want = reference(served, tok(prompt)["input_ids"], 12, strategy)
        want_text = tok.decode(want, skip_special_tokens=True)
        r = client.completions.create(model=served.name, prompt=prompt, max_tokens=12, extra_body=extra)
        assert r.choices[0].text == want_text, strategy
        assert r.usage.completion_tokens == len(want) and r.usage.prompt_tokens == len(tok(prompt)["input_ids"])
        assert r.model_extra["dllm_stats"]["decoding_strategy"] == strategy
        assert r.model_extra["dllm_stats"]["nfe"] >= 1
        text, last = _stream_text(client.completions.create(model=served.name, prompt=prompt, max_tokens=12,
                                                            stream=True, extra_body=extra))
        assert text == want_text and last.usage.completion_tokens == len(want), strategy
        assert last.model_extra["dllm_stats"]["tokens_per_forward"] > 0

        want = reference(served, chat_ids, 12, strategy)
        want_text = tok.decode(want, skip_special_tokens=True)
        messages = [{"role": "user", "content": question}]
        r = client.chat.completions.create(model=served.name, messages=messages, max_tokens=12, extra_body=extra)
        assert r.choices[0].message.content == want_text and r.usage.completion_tokens == len(want), strategy
        text, last = _stream_text(client.chat.completions.create(model=served.name, messages=messages,
                                                                 max_tokens=12, stream=True, extra_body=extra))
        assert text == want_text and last.choices[0].finish_reason in ("stop", "length"), strategy


def test_concurrent_batches_give_each_request_its_batch_one_tokens(family):
    """`max_concurrent_batches=2` (two workers sharing the model, drafter pairs included): concurrent requests of
    every strategy of the family, greedy and seeded sampling (so several groups decode at the same time), each get
    the tokens of their own batch-1 `generate` call."""
    import dataclasses

    served, _, strategies = family
    tok = served.tokenizer
    prompts = [f"Question: {q}\nAnswer:" for q in QUESTIONS[:6]]
    cases = [(prompts[i], strategies[i % len(strategies)], i % 3 == 2) for i in range(6)]
    with running(dataclasses.replace(served, max_concurrent_batches=2)) as (client, base, app):
        def ask(i):
            prompt, strategy, sampled = cases[i]
            extra = {"temperature": 0.8, "seed": 40 + i} if sampled else {}
            return client.completions.create(model=served.name, prompt=prompt, max_tokens=8,
                                             extra_body={"decoding_strategy": strategy}, **extra).choices[0].text

        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            texts = list(pool.map(ask, range(6)))
    for i, (prompt, strategy, sampled) in enumerate(cases):
        extra = dict(do_sample=True, temperature=0.8, generator=[torch.Generator().manual_seed(40 + i)], **NEUTRAL) \
            if sampled else {}
        want = reference(served, tok(prompt)["input_ids"], 8, strategy, **extra)
        assert texts[i] == tok.decode(want, skip_special_tokens=True), (i, strategy, sampled)


@pytest.fixture(scope="module")
def sdar(one_thread):
    served = load_served_model(str(MODELS / "sdar-tiny-arith"))
    with running(served) as (client, base, app):
        yield served, client, base, app


def test_concurrent_streams_are_batched_each_with_its_batch_one_tokens(sdar):
    """16 streaming requests of different prompts and budgets at once: each gets its own batch-1 tokens, some
    share a batch, and `/health` answers while they decode."""
    served, client, base, app = sdar
    tok = served.tokenizer
    prompts = [f"Question: {q}\nAnswer:" for q in QUESTIONS]
    budgets = [3 + 2 * i for i in range(16)]
    before = len(app.state.batcher.history)

    def ask(i):
        return _stream_text(client.completions.create(model=served.name, prompt=prompts[i], max_tokens=budgets[i],
                                                      stream=True))[0]

    answers = []
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        futures = [pool.submit(ask, i) for i in range(16)]
        while not all(f.done() for f in futures):
            answers.append(health(base))
            time.sleep(0.05)
        texts = [f.result(timeout=60) for f in futures]
    for i, text in enumerate(texts):
        want = reference(served, tok(prompts[i])["input_ids"], budgets[i], served.default_strategy)
        assert text == tok.decode(want, skip_special_tokens=True), i
    rows = list(app.state.batcher.history)[before:]
    assert len(rows) == 16 and max(r["batch_size"] for r in rows) > 1
    assert any(h["running"] > 0 for h in answers) and all(h["status"] == "ok" for h in answers)


def test_seeded_sampled_requests_share_a_batch_each_with_its_own_tokens(sdar):
    """Sampling (temperature > 0) with a seed per request: concurrent requests are batched, and each gets the
    tokens of `generate(do_sample=True, generator=[torch.Generator().manual_seed(seed)], top_k=0, top_p=1.0)` on
    its own (`NEUTRAL`)."""
    served, client, base, app = sdar
    tok = served.tokenizer
    prompts = [f"Question: {q}\nAnswer:" for q in QUESTIONS[:6]]
    before = len(app.state.batcher.history)

    def ask(i):
        return client.completions.create(model=served.name, prompt=prompts[i], max_tokens=8, temperature=0.9,
                                         seed=100 + i).choices[0].text

    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        texts = list(pool.map(ask, range(6)))
    for i, text in enumerate(texts):
        want = reference(served, tok(prompts[i])["input_ids"], 8, served.default_strategy, do_sample=True,
                         temperature=0.9, generator=[torch.Generator().manual_seed(100 + i)], **NEUTRAL)
        assert text == tok.decode(want, skip_special_tokens=True), i
    assert max(r["batch_size"] for r in list(app.state.batcher.history)[before:]) > 1


def _choices_of_stream(stream) -> tuple[dict[int, str], list]:
    """The text of each choice (by `index`) of a streamed response, and its chunks."""
    texts, chunks = {}, list(stream)
    for chunk in chunks:
        for choice in chunk.choices:
            piece = (choice.delta.content or "") if hasattr(choice, "delta") else choice.text
            texts[choice.index] = texts.get(choice.index, "") + piece
    return texts, chunks


def test_a_list_of_prompts_gets_a_choice_per_prompt_each_with_its_batch_one_tokens(sdar):
    """`/v1/completions` with several prompts (strings and token ids, as LangChain's `OpenAI.batch` sends them):
    choice i is prompt i's completion, with the tokens of its own batch-1 `generate`; the usage counts every prompt
    and completion, each choice carries its `dllm_stats`; streamed, the choices' texts are the same and only the last
    chunk carries the usage."""
    served, client, base, app = sdar
    tok = served.tokenizer
    prompts = [f"Question: {q}\nAnswer:" for q in QUESTIONS[:3]]
    sent = [prompts[0], tok(prompts[1])["input_ids"], prompts[2]]
    ids = [reference(served, tok(p)["input_ids"], 6, served.default_strategy) for p in prompts]
    want = [tok.decode(i, skip_special_tokens=True) for i in ids]
    r = client.completions.create(model=served.name, prompt=sent, max_tokens=6)
    assert [c.index for c in r.choices] == [0, 1, 2] and [c.text for c in r.choices] == want
    assert r.usage.prompt_tokens == sum(len(tok(p)["input_ids"]) for p in prompts)
    assert r.usage.completion_tokens == sum(len(i) for i in ids)
    stats = [c.model_extra["dllm_stats"] for c in r.choices]
    assert all(s["decoding_strategy"] == served.default_strategy and s["nfe"] >= 1 for s in stats)
    assert "dllm_stats" not in r.model_extra
    texts, chunks = _choices_of_stream(client.completions.create(model=served.name, prompt=sent, max_tokens=6,
                                                                 stream=True))
    assert texts == dict(enumerate(want))
    with_usage = [c for c in chunks if c.usage is not None]
    assert with_usage == [chunks[-1]] and chunks[-1].usage == r.usage
    finished = [choice.index for c in chunks for choice in c.choices if choice.finish_reason]
    assert sorted(finished) == [0, 1, 2]


def test_n_completions_sample_with_consecutive_seeds(sdar):
    """`n=3` with `seed=s`: completion j has the tokens of the same request with `n=1` and seed `s + j` (so they
    differ and each is reproducible); greedy, the n completions are equal; a chat stream gives each choice its role
    chunk and its text."""
    served, client, base, app = sdar
    tok = served.tokenizer
    prompt = f"Question: {QUESTIONS[0]}\nAnswer:"
    r = client.completions.create(model=served.name, prompt=prompt, max_tokens=8, temperature=1.5, seed=70, n=3)
    alone = [client.completions.create(model=served.name, prompt=prompt, max_tokens=8, temperature=1.5,
                                       seed=70 + j).choices[0].text for j in range(3)]
    assert [c.text for c in r.choices] == alone and len(set(alone)) > 1
    assert r.usage.prompt_tokens == len(tok(prompt)["input_ids"])             # the prompt counts once, not n times
    want = reference(served, tok(prompt)["input_ids"], 8, served.default_strategy, do_sample=True, temperature=1.5,
                     generator=[torch.Generator().manual_seed(71)], **NEUTRAL)
    assert alone[1] == tok.decode(want, skip_special_tokens=True)
    greedy = client.completions.create(model=served.name, prompt=prompt, max_tokens=8, n=2)
    assert greedy.choices[0].text == greedy.choices[1].text
    messages = [{"role": "user", "content": QUESTIONS[1]}]
    whole = client.chat.completions.create(model=served.name, messages=messages, max_tokens=8, temperature=1.5,
                                           seed=5, n=2)
    texts, chunks = _choices_of_stream(client.chat.completions.create(
        model=served.name, messages=messages, max_tokens=8, temperature=1.5, seed=5, n=2, stream=True))
    assert texts == {c.index: c.message.content for c in whole.choices}
    roles = [choice.index for c in chunks for choice in c.choices if choice.delta.role == "assistant"]
    assert sorted(roles) == [0, 1]


def test_requests_with_their_own_sampling_settings_share_a_batch(sdar):
    """Sampled requests with different temperatures, top-p and top-k join one batch; each gets the tokens of its own
    batch-1 `generate(do_sample=True, temperature=..., top_p=..., top_k=..., generator=[seeded])` call."""
    served, client, base, app = sdar
    tok = served.tokenizer
    prompts = [f"Question: {q}\nAnswer:" for q in QUESTIONS[:6]]
    settings = [dict(temperature=0.6), dict(temperature=1.2, top_p=0.9), dict(temperature=0.9),
                dict(temperature=0.8, top_p=0.7), dict(temperature=1.0, top_k=5), dict(temperature=0.5, top_p=0.95)]
    before = len(app.state.batcher.history)

    def ask(i):
        extra = {"top_k": settings[i]["top_k"]} if "top_k" in settings[i] else {}
        kwargs = {k: v for k, v in settings[i].items() if k != "top_k"}
        return client.completions.create(model=served.name, prompt=prompts[i], max_tokens=8, seed=200 + i,
                                         extra_body=extra, **kwargs).choices[0].text

    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        texts = list(pool.map(ask, range(6)))
    for i, text in enumerate(texts):
        want = reference(served, tok(prompts[i])["input_ids"], 8, served.default_strategy, do_sample=True,
                         generator=[torch.Generator().manual_seed(200 + i)], **{**NEUTRAL, **settings[i]})
        assert text == tok.decode(want, skip_special_tokens=True), (i, settings[i])
    assert max(r["batch_size"] for r in list(app.state.batcher.history)[before:]) > 1


# -- text deltas: what a streamed response's chunks carry -----------------------------------------------------------
_TEXT = "12+30=42 你好 😀 é x\n日本語 🙂🙂 done"


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(MODELS / "sdar-tiny-arith")


@given(cuts=st.lists(st.integers(0, 64), max_size=12))
@settings(max_examples=60, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_text_deltas_join_to_the_whole_decode_in_any_split(tokenizer, cuts):
    """Streamed in any split of its ids (byte tokens of multi-byte characters included), the chunks join to the
    non-streamed text, and no chunk but the last shows an incomplete character."""
    ids = tokenizer(_TEXT, add_special_tokens=False).input_ids + [tokenizer.eos_token_id]
    bounds = sorted({min(c, len(ids)) for c in cuts} | {0, len(ids)})
    deltas, sent = TextDeltas(tokenizer), []
    for start, end in zip(bounds, bounds[1:]):
        sent.append(deltas.add(ids[start:end]))
    sent.append(deltas.add([], final=True))
    assert "".join(sent) == tokenizer.decode(ids, skip_special_tokens=True) == _TEXT
    assert not any("\ufffd" in text for text in sent)


def test_text_deltas_decode_a_window_not_the_whole_output(tokenizer, monkeypatch):
    """One id at a time over a long output, each decode reads a few ids (it decoded the whole output per chunk:
    quadratic in the output's length)."""
    ids = tokenizer(_TEXT * 40, add_special_tokens=False).input_ids
    deltas, seen, decode = TextDeltas(tokenizer), [], tokenizer.decode
    monkeypatch.setattr(tokenizer, "decode", lambda x, **kw: seen.append(len(x)) or decode(x, **kw))
    text = "".join(deltas.add([i]) for i in ids) + deltas.add([], final=True)
    assert text == _TEXT * 40 and len(ids) > 800
    assert max(seen) <= 8, max(seen)


def test_a_draft_continues_the_text_sent_so_far(tokenizer):
    """A draft that completes a character whose first bytes are final (held back) shows that character, not
    "\\ufffd" and a loss of the held-back bytes; a character the draft leaves incomplete is not shown."""
    ids = tokenizer("ok 😀🙂", add_special_tokens=False).input_ids
    split = next(i for i in range(1, len(ids)) if tokenizer.decode(ids[:i]).endswith("\ufffd"))
    deltas = TextDeltas(tokenizer)
    sent = deltas.add(ids[:split])
    assert "\ufffd" not in sent
    assert sent + deltas.draft(ids[split:]) == "ok 😀🙂"
    assert sent + deltas.draft(ids[split:-1]) == tokenizer.decode(ids[:-1]).rstrip("\ufffd")
    assert "\ufffd" not in deltas.draft(ids[split:split + 1])


def test_a_seeded_request_gets_the_same_text_with_and_without_drafts(sdar):
    """One sampled request and seed, streamed with `stream_drafts` (a `generate` call of its own) or in a batch:
    the same committed text, the one of `generate` with the request's warpers and the neutral ones (`NEUTRAL`).
    Before, the drafts' call left top-k unset, and transformers' fallback top-k of 50 cut a flat distribution."""
    served, client, base, app = sdar
    tok = served.tokenizer
    prompt = f"Question: {QUESTIONS[3]}\nAnswer:"
    texts = []
    for extra in ({}, {"stream_drafts": True}):
        stream = client.completions.create(model=served.name, prompt=prompt, max_tokens=24, stream=True,
                                           temperature=3.0, seed=7, extra_body=extra)
        texts.append("".join(chunk.choices[0].text for chunk in stream
                             if chunk.choices and (chunk.model_extra or {}).get("dllm_draft") is None))
    want = reference(served, tok(prompt)["input_ids"], 24, served.default_strategy, do_sample=True,
                     temperature=3.0, generator=[torch.Generator().manual_seed(7)], **NEUTRAL)
    assert texts[0] == texts[1] == tok.decode(want, skip_special_tokens=True)


def test_stream_drafts_sends_the_drafts_of_generate_marked_as_such(sdar):
    """`stream_drafts=true`: the chunks marked `dllm_draft` are the drafts a `TextDiffusionStreamer` gets from
    `generate` (same tokens, same order, between the same commits); the choices carry only the final text."""
    served, client, base, app = sdar
    tok = served.tokenizer
    prompt = f"Question: {QUESTIONS[2]}\nAnswer:"
    ids = tok(prompt)["input_ids"]
    events = []

    class Recorder:
        def put(self, value):
            events.append(("put", value.reshape(-1).tolist()))

        def put_draft(self, value):
            events.append(("draft", value.reshape(-1).tolist()))

        def end(self):
            pass

    served.model.generate(torch.tensor([ids]), decoding_strategy=served.default_strategy, max_new_tokens=12,
                          streamer=Recorder())
    want = [(kind, tokens) for kind, tokens in events[1:]]          # without the prompt
    stream = client.completions.create(model=served.name, prompt=prompt, max_tokens=12, stream=True,
                                       extra_body={"stream_drafts": True})
    got, text = [], ""
    for chunk in stream:
        draft = (chunk.model_extra or {}).get("dllm_draft")
        if draft is not None:
            assert chunk.choices[0].text == ""
            got.append(("draft", draft["token_ids"]))
        elif chunk.choices and chunk.choices[0].text:
            got.append(("text", chunk.choices[0].text))
            text += chunk.choices[0].text
    assert [t for kind, t in got if kind == "draft"] == [t for kind, t in want if kind == "draft"]
    assert len([t for kind, t in want if kind == "draft"]) > 0
    committed = [t for _, tokens in want if _ == "put" for t in tokens]
    assert text == tok.decode(committed, skip_special_tokens=True)
    code, body = post(base, "/v1/completions", {"model": served.name, "prompt": prompt, "stream_drafts": True})
    assert code == 400 and "`stream_drafts` (=True) must come with stream=True" in body


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "whole"])
def test_a_client_that_goes_away_frees_its_row(sdar, stream):
    """A request whose client closes the connection while it decodes ends early (its row leaves the batch) and
    the server keeps serving; a non-streamed one too (it decoded its whole budget: the handler never looked)."""
    served, client, base, app = sdar
    history = app.state.batcher.history
    before = len(history)
    conn = http.client.HTTPConnection(base.split("//")[1], timeout=30)
    body = {"model": served.name, "prompt": "#\n#\n#\n#\n", "max_tokens": 1500, "stream": stream,
            "ignore_eos": True}
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    if stream:
        response = conn.getresponse()
        assert response.status == 200
        assert response.readline().startswith(b"data:")
    else:
        deadline = time.monotonic() + 30
        while not health(base)["running"] and time.monotonic() < deadline:
            time.sleep(0.02)
        assert health(base)["running"] == 1
    conn.close()                                   # the client goes away (after its first chunk, if streamed)
    deadline = time.monotonic() + 30
    while (len(history) == before or health(base)["running"]) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert health(base)["running"] == 0 and len(history) == before + 1
    row = history[before]
    assert row["finish_reason"] == "cancelled" and row["tokens"] < 1500
    r = client.completions.create(model=served.name, prompt="Question: 1 + 1?\nAnswer:", max_tokens=4)
    assert r.usage.completion_tokens >= 1


def test_a_short_request_joins_running_long_streams_and_cancelled_rows_leave_at_once(sdar):
    """Continuous batching: while 8 long `ignore_eos` streams decode, a short request joins their batch (it does not
    wait for them) and gets its batch-1 tokens; when the 8 clients go away, their rows leave at once."""
    served, client, base, app = sdar
    history = app.state.batcher.history
    before = len(history)
    body = {"model": served.name, "prompt": "#\n#\n", "max_tokens": 1000, "stream": True, "ignore_eos": True}
    connections = []
    for _ in range(8):
        conn = http.client.HTTPConnection(base.split("//")[1], timeout=60)
        conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        connections.append((conn, conn.getresponse()))
    for conn, response in connections:
        assert response.status == 200 and response.readline().startswith(b"data:")     # all 8 are decoding
    prompt = "Question: 2 + 3?\nAnswer:"
    r = client.completions.create(model=served.name, prompt=prompt, max_tokens=4)
    running = health(base)["running"]
    first = list(history)[before]
    assert first["id"] == r.id, "the short request finished after a long one"
    assert first["batch_size"] > 1 and running == 8                                   # it joined their batch
    want = reference(served, served.tokenizer(prompt)["input_ids"], 4, served.default_strategy)
    assert r.choices[0].text == served.tokenizer.decode(want, skip_special_tokens=True)
    for conn, _ in connections:
        conn.close()                                           # the 8 clients go away
    deadline = time.monotonic() + 30
    while health(base)["running"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert health(base)["running"] == 0
    rows = list(history)[before + 1:]
    assert len(rows) == 8 and all(row["finish_reason"] == "cancelled" and row["tokens"] < 1000 for row in rows)


BAD = [
    pytest.param({"model": "other"}, 404, "`model` (='other')", "model", id="unknown-model"),
    pytest.param({"decoding_strategy": "nope"}, 400, "`decoding_strategy` (='nope')", "decoding_strategy",
                 id="unknown-strategy"),
    pytest.param({"block_size": 0}, 400, "`block_size` (=0)", "block_size", id="bad-parameter"),
    pytest.param({"no_such_option": 1}, 400, "`no_such_option` (=1) must be a parameter", "no_such_option",
                 id="unknown-parameter"),
    pytest.param({"max_tokens": 0}, 400, "`max_tokens` (=0)", "max_tokens", id="max-tokens-0"),
    pytest.param({"max_tokens": -3}, 400, "`max_tokens` (=-3)", "max_tokens", id="max-tokens-negative"),
    pytest.param({"n": 129}, 400, "`n` (=129)", "n", id="n-129"),
    pytest.param({"prompt": [5] * 2100}, 400, "`prompt` (='<prompt of 2100 tokens>') must fit with max_tokens=4",
                 "prompt", id="too-long"),
    pytest.param({"decoding_strategy": "simsd"}, 400, "--draft-model PATH`", "decoding_strategy", id="no-drafter"),
    pytest.param({"logprobs": 2}, 400, "`logprobs` (=2)", "logprobs", id="unsupported-field"),
    pytest.param({"max_completion_tokens": 4}, 400, "`max_completion_tokens` (=4) must be left out: /v1/completions "
                 "has no such field; pass `max_tokens`", "max_completion_tokens", id="chat-only-field"),
]


@pytest.mark.parametrize("change, status, message, param", BAD)
def test_bad_requests_get_4xx_with_the_library_message_and_the_server_keeps_serving(sdar, change, status, message,
                                                                                    param):
    served, client, base, app = sdar
    body = {"model": served.name, "prompt": "Question: 1 + 1?\nAnswer:", "max_tokens": 4, **change}
    for stream in (False, True):
        code, text = post(base, "/v1/completions", {**body, "stream": stream})
        assert code == status, text
        assert message in json.loads(text)["error"]["message"]
        assert json.loads(text)["error"]["param"] == param
    assert health(base)["status"] == "ok"
    assert client.completions.create(model=served.name, prompt="Question: 1 + 1?\nAnswer:",
                                     max_tokens=4).usage.completion_tokens >= 1


def test_models_route_lists_the_served_model(sdar):
    served, client, base, app = sdar
    assert [m.id for m in client.models.list()] == [served.name]


def test_settings_a_typical_request_can_use_start_the_server():
    """The start-time check builds the plan of a typical request (a 64-token prompt): blocks of 64 with a default
    budget of 8 serve such prompts (a one-token prompt with that budget allowed blocks of 16 only); a drafter loaded
    for the requests that name a drafting strategy does not refuse a default strategy that drafts with the target."""
    load_served_model(str(MODELS / "sdar-tiny-arith"), strategy="block_diffusion", params={"block_size": 64},
                      default_max_tokens=8)
    load_served_model(str(MODELS / "qwen2-tiny-ar"), draft_model=str(MODELS / "deer-drafter-tiny"), strategy="ar")
    load_served_model(str(MODELS / "sdar-tiny-arith"), strategy="s2d2", params={"s2d2_acceptance": "stochastic"})


def test_serve_command_refuses_a_bad_option_before_serving(capsys):
    from hf_dllm_spec.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["serve", str(MODELS / "sdar-tiny-arith"), "--strategy", "s2d2", "--param", "block_size=0"])
    assert exit_info.value.code == 2 and "`block_size` (=0) must be an integer >= 1" in capsys.readouterr().err
    # a default strategy that can never run (no drafter), a port out of range, a device torch cannot use: usage
    # errors before anything loads (the first served 400s to every default request, the others were tracebacks)
    # a default strategy the model cannot decode (S2D2 on an AR model without a mask token: it served a 400 blaming
    # the client for every default request), an empty --allowed-hosts or --api-key (each silently served anyone)
    sdar = str(MODELS / "sdar-tiny-arith")
    for argv, expected in (([str(MODELS / "qwen2-tiny-ar"), "--strategy", "deer"], "pass --draft-model PATH"),
                           ([sdar, "--port", "70000"], "--port must be in [0, 65535]"),
                           ([sdar, "--device", "foo"], "argument --device: must be a"),
                           ([str(MODELS / "qwen2-tiny-ar"), "--strategy", "s2d2"], "`mask_token_id` (=None) must be "
                            "known for decoding_strategy='s2d2'"),
                           ([sdar, "--allowed-hosts", ""], "argument --allowed-hosts: must name at least one host"),
                           ([sdar, "--allowed-hosts", " , "], "argument --allowed-hosts: must name at least one host"),
                           ([sdar, "--api-key", ""], "argument --api-key: must not be empty")):
        with pytest.raises(SystemExit) as exit_info:
            main(["serve", *argv])
        assert exit_info.value.code == 2 and expected in capsys.readouterr().err, argv


@pytest.mark.slow
def test_serve_command_serves_until_stopped(tmp_path):
    """`hf-dllm-spec serve MODEL --port 0` in a subprocess: `/health` answers, the `openai` client gets the
    tokens of `generate` with the `--strategy` and `--param` given, and the process stops when terminated."""
    import queue
    import re
    import subprocess
    import sys
    import threading

    model = MODELS / "sdar-tiny-arith"
    # `--port 0`: the server binds a free port itself and logs it (no port picked here that another test may take)
    process = subprocess.Popen([sys.executable, "-m", "hf_dllm_spec.cli", "serve", str(model), "--port", "0",
                                "--strategy", "s2d2", "--param", "block_size=4"],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in iter(process.stdout.readline, b"")],
                     daemon=True).start()
    try:
        deadline, log, port = time.monotonic() + 120, [], None
        while port is None:
            try:
                log.append(lines.get(timeout=max(deadline - time.monotonic(), 0.01)).decode())
            except queue.Empty:
                pytest.fail("the server did not log its port within 120 s:\n" + "".join(log))
            found = re.search(r"Uvicorn running on http://127\.0\.0\.1:(\d+)", log[-1])
            port = int(found.group(1)) if found else None
            assert port is not None or process.poll() is None, "".join(log)
        base = f"http://127.0.0.1:{port}"
        assert health(base)["status"] == "ok"
        served = load_served_model(str(model), strategy="s2d2", params={"block_size": 4})
        prompt = f"Question: {QUESTIONS[1]}\nAnswer:"
        want = reference(served, served.tokenizer(prompt)["input_ids"], 10, "s2d2", block_size=4)
        client = openai.OpenAI(base_url=base + "/v1", api_key="unused", timeout=60, max_retries=0)
        r = client.completions.create(model="sdar-tiny-arith", prompt=prompt, max_tokens=10)
        assert r.choices[0].text == served.tokenizer.decode(want, skip_special_tokens=True)
    finally:
        process.terminate()
        process.wait(timeout=30)


def test_benchmark_reports_every_setting_with_the_baseline_texts(one_thread, capsys):
    """`hf_dllm_spec.tools.serving_bench` (tiny settings, both runtimes): a row per runtime and setting with latency
    and time to first token, each run returned the baseline's texts."""
    from hf_dllm_spec.tools import serving_bench

    rows = serving_bench.main(["--num-prompts", "3", "--max-tokens", "4", "--concurrency", "1", "3", "--repeats", "1",
                       "--runtimes", "eager", "static"])
    table = capsys.readouterr().out
    for runtime in ("eager", "static"):
        assert f"| {runtime} | generate, one at a time |" in table and f"| {runtime} | server, 3 concurrent clients |" \
            in table
    assert table.count("| yes |") == 6 and "| NO |" not in table
    assert all(r["p50_s"] <= r["p95_s"] for r in rows)
    assert all((r["ttft_p50_s"] is None) == r["setting"].startswith("generate") for r in rows)


def test_static_runtime_server_batches_give_the_eager_tokens(one_thread):
    """`serve --cache-implementation static`: concurrent requests batched under the static runtime (target and
    DEER drafter, whose static states then live on the models) return the eager runtime's batch-1 tokens."""
    served = load_served_model(str(MODELS / "qwen2-tiny-ar"), draft_model=str(MODELS / "deer-drafter-tiny"),
                               strategy="deer", cache_implementation="static")
    assert served.model.generation_config.cache_implementation == "static"
    prompts = [f"Question: {q}\nAnswer:" for q in QUESTIONS[:4]]
    served.model.generation_config.cache_implementation = None            # the eager reference
    want = [served.tokenizer.decode(reference(served, served.tokenizer(p)["input_ids"], 10, "deer"),
                                    skip_special_tokens=True) for p in prompts]
    served.model.generation_config.cache_implementation = "static"
    with running(served) as (client, base, app), concurrent.futures.ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda p: client.completions.create(model=served.name, prompt=p, max_tokens=10), prompts))
    assert [r.choices[0].text for r in got] == want
    assert STATE_ATTRIBUTE in served.model.__dict__ and STATE_ATTRIBUTE in served.drafter.__dict__
