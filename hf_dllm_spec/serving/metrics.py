"""The server's `/metrics`: Prometheus text exposition through `prometheus_client` (the `serve` extra).

Each app has its own `CollectorRegistry` (several servers in one process, e.g. tests, do not share counters).
Metrics, all prefixed `hf_dllm_spec_` (`strategy` is the request's `decoding_strategy`; a request of several
completions, `n` or a list of prompts, counts as that many requests, a row each):

| metric | type | what |
|---|---|---|
| `requests_running` / `requests_waiting` | gauge | rows in the batch in progress / requests queued for a batch |
| `requests_total{strategy, finish_reason}` | counter | finished requests ("stop", "length", "cancelled") |
| `request_errors_total{status}` | counter | requests refused after they were queued (the library's 400s, 500s) |
| `prompt_tokens_total{strategy}`, `generation_tokens_total{strategy}` | counter | tokens in and out |
| `generation_tokens_per_second` | gauge | tokens streamed over the last `window_s` seconds (default 10), per second |
| `time_to_first_token_seconds{strategy}` | histogram | from the request joining the queue to its first final token |
| `request_latency_seconds{strategy}` | histogram | from joining the queue to the last token |
| `forwards_total{strategy}`, `draft_tokens_total{strategy}`, `accepted_tokens_total{strategy}` | counter | the library's per-row statistics (NFE the row took part in, drafted and accepted tokens) summed |
| `tokens_per_forward{strategy}`, `acceptance_rate{strategy}` | gauge | generation tokens / forwards and accepted / drafted tokens, over every finished request (acceptance only for strategies that draft) |

The batcher's worker thread reports through :meth:`ServerMetrics.tokens` and :meth:`ServerMetrics.done`
(`prometheus_client` metrics are thread-safe); the gauges of the queue are read from the batcher when scraped.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

PREFIX = "hf_dllm_spec_"
#: Buckets of the time-to-first-token and latency histograms, in seconds.
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class ServerMetrics:
    """The metrics of one server (see the module docstring).

    Args:
        status (`Callable[[], dict]`): the batcher's `status()` (`"running"`, `"queued"`), read at each scrape.
        window_s (`float`, defaults to 10): the window of `generation_tokens_per_second`, in seconds.
    """

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, status, window_s: float = 10.0) -> None:
        self.registry = registry = CollectorRegistry()
        self.window_s = window_s
        self._recent: deque[tuple[float, int]] = deque()         # (time, tokens) of the last window
        self._lock = threading.Lock()
        self._totals: dict[str, dict[str, float]] = {}            # strategy -> tokens, forwards, drafted, accepted

        def gauge(name: str, doc: str, read) -> None:
            Gauge(PREFIX + name, doc, registry=registry).set_function(read)

        gauge("requests_running", "Requests in the batch being decoded.", lambda: status()["running"])
        gauge("requests_waiting", "Requests queued for a batch.", lambda: status()["queued"])
        gauge("generation_tokens_per_second", f"Generated tokens per second over the last {window_s:g} s.",
              self._rate)
        self.requests = Counter(PREFIX + "requests", "Finished requests.", ["strategy", "finish_reason"],
                                registry=registry)
        self.errors = Counter(PREFIX + "request_errors", "Requests refused or failed after they were queued.",
                              ["status"], registry=registry)
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Prompt tokens of finished requests.", ["strategy"],
                                     registry=registry)
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "Generated tokens.", ["strategy"],
                                         registry=registry)
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds", "From queued to the first final token.",
                              ["strategy"], buckets=LATENCY_BUCKETS, registry=registry)
        self.latency = Histogram(PREFIX + "request_latency_seconds", "From queued to the last token.", ["strategy"],
                                 buckets=LATENCY_BUCKETS, registry=registry)
        self.forwards = Counter(PREFIX + "forwards", "Forwards (NFE) the finished requests' rows took part in.",
                                ["strategy"], registry=registry)
        self.draft_tokens = Counter(PREFIX + "draft_tokens", "Drafted tokens of finished requests.", ["strategy"],
                                    registry=registry)
        self.accepted_tokens = Counter(PREFIX + "accepted_tokens", "Accepted draft tokens of finished requests.",
                                       ["strategy"], registry=registry)
        self.tokens_per_forward = Gauge(PREFIX + "tokens_per_forward", "Generated tokens per forward, all finished "
                                        "requests.", ["strategy"], registry=registry)
        self.acceptance_rate = Gauge(PREFIX + "acceptance_rate", "Accepted / drafted tokens, all finished requests.",
                                     ["strategy"], registry=registry)

    def _prune(self, now: float) -> None:
        """Drop the token events older than the window (under the lock): the buffer holds one window at most."""
        while self._recent and self._recent[0][0] < now - self.window_s:
            self._recent.popleft()

    def _rate(self) -> float:
        now = time.monotonic()
        with self._lock:
            self._prune(now)
            return sum(n for _, n in self._recent) / self.window_s

    def tokens(self, strategy: str, count: int, first: bool, waited_s: float) -> None:
        """`count` tokens of a request became final; `first`: its first ones, `waited_s` after it was queued."""
        now = time.monotonic()
        with self._lock:
            self._prune(now)
            self._recent.append((now, count))
        self.generation_tokens.labels(strategy).inc(count)
        if first:
            self.ttft.labels(strategy).observe(waited_s)

    def done(self, strategy: str, finish_reason: str, prompt_tokens: int, completion_tokens: int,
             stats: dict[str, Any], latency_s: float) -> None:
        """A request finished with the library's statistics of its row (`dllm_stats`)."""
        self.requests.labels(strategy, finish_reason).inc()
        self.prompt_tokens.labels(strategy).inc(prompt_tokens)
        self.latency.labels(strategy).observe(latency_s)
        drafted, accepted = stats.get("num_draft_tokens") or 0, stats.get("num_accepted_tokens") or 0
        nfe = stats.get("nfe") or 0
        self.forwards.labels(strategy).inc(nfe)
        self.draft_tokens.labels(strategy).inc(drafted)
        self.accepted_tokens.labels(strategy).inc(accepted)
        with self._lock:
            total = self._totals.setdefault(strategy, {"tokens": 0, "forwards": 0, "drafted": 0, "accepted": 0})
            total["tokens"] += completion_tokens
            total["forwards"] += nfe
            total["drafted"] += drafted
            total["accepted"] += accepted
            if total["forwards"]:
                self.tokens_per_forward.labels(strategy).set(total["tokens"] / total["forwards"])
            if total["drafted"]:
                self.acceptance_rate.labels(strategy).set(total["accepted"] / total["drafted"])

    def error(self, status: int) -> None:
        """A queued request was refused or failed with HTTP `status` (400, 500): counted in
        `request_errors_total{status}`."""
        self.errors.labels(str(status)).inc()

    def exposition(self) -> bytes:
        """The Prometheus text of every metric."""
        return generate_latest(self.registry)
