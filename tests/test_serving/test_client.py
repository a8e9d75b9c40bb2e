"""The OpenAI-compatible client against a small local HTTP server: retries with backoff on 5xx, no retry on
4xx, a server that is gone, and Prometheus /metrics parsing. No vLLM needed."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from dflash_ds.errors import DFlashError
from dflash_ds.serving.client import OpenAIClient, ServerError, parse_metrics
from dflash_ds.serving.vllm_server import free_port

METRICS = """# HELP vllm:spec_decode_num_drafts Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 19.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="0"} 7.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="1",model_name="m",position="0"} 2.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="1"} 3.0
"""


@pytest.fixture
def server():
    """Answers /v1/models; /v1/completions fails with `fail_status` `failures` times, then answers: partly with
    finish_reason 'abort' (as vLLM does for a request it aborted) `aborts` times, then whole."""
    state = {"calls": 0, "failures": 2, "fail_status": 503, "times": [], "aborts": 0, "reason": "abort"}

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *_args) -> None:
            pass

        def _send(self, status: int, body: str, kind: str = "application/json") -> None:
            self.send_response(status)
            self.send_header("Content-Type", kind)
            self.end_headers()
            self.wfile.write(body.encode())

        def do_GET(self) -> None:
            if self.path == "/metrics":
                return self._send(200, METRICS, "text/plain")
            self._send(200, json.dumps({"data": [{"id": "tiny"}]}))

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            state["calls"] += 1
            state["times"].append(time.monotonic())
            if state["calls"] <= state["failures"]:
                return self._send(state["fail_status"], '{"error": "busy"}')
            assert body["model"] == "tiny" and body["prompt"] == [1, 2] and body["return_token_ids"] is True
            if state["calls"] <= state["failures"] + state["aborts"]:
                part = {"text": "a", "token_ids": [5], "finish_reason": state["reason"]}
                return self._send(200, json.dumps({"choices": [part]}))
            self._send(200, json.dumps({"choices": [{"text": "ab", "token_ids": [5, 6], "finish_reason": "length"}]}))

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}", state
    httpd.shutdown()


def test_retries_5xx_with_backoff_then_succeeds(server):
    url, state = server
    answer = OpenAIClient(url + "/v1", retries=3, backoff_s=0.2).complete_ids([1, 2], max_tokens=2)
    assert (answer.token_ids, answer.finish_reason, answer.text) == ([5, 6], "length", "ab")
    assert state["calls"] == 3
    gaps = [b - a for a, b in zip(state["times"], state["times"][1:])]
    assert gaps[0] >= 0.2 and gaps[1] >= 0.4  # the wait doubles


def test_gives_up_after_its_retries_and_never_retries_a_4xx(server):
    url, state = server
    state["failures"] = 10
    with pytest.raises(ServerError, match=r"HTTP 503.*after 2 attempts"):
        OpenAIClient(url, retries=1, backoff_s=0.01).complete_ids([1, 2], max_tokens=2)
    state.update(calls=0, fail_status=400)
    with pytest.raises(ServerError, match="HTTP 400"):
        OpenAIClient(url, retries=3, backoff_s=0.01).complete_ids([1, 2], max_tokens=2)
    assert state["calls"] == 1


def test_an_aborted_answer_is_never_taken_for_a_whole_one(server):
    """vLLM answers 200 with the partial text and finish_reason 'abort' for a request it aborted (its server shutting
    down): retried like a 5xx, and refused when the aborts outlast the retries; 'error' fails at once."""
    url, state = server
    state.update(failures=0, aborts=2)
    answer = OpenAIClient(url, retries=2, backoff_s=0.01).complete_ids([1, 2], max_tokens=2)
    assert (answer.token_ids, answer.finish_reason, state["calls"]) == ([5, 6], "length", 3)
    state.update(calls=0, aborts=5)
    with pytest.raises(ServerError, match=r"finish_reason 'abort'.*after 2 attempts"):
        OpenAIClient(url, retries=1, backoff_s=0.01).complete_ids([1, 2], max_tokens=2)
    state.update(calls=0, aborts=1, reason="error")
    with pytest.raises(ServerError, match=r"finish_reason 'error', not 'stop' or 'length'$"):
        OpenAIClient(url, retries=3, backoff_s=0.01).complete_ids([1, 2], max_tokens=2)
    assert state["calls"] == 1


def test_a_server_that_is_gone():
    url = f"http://127.0.0.1:{free_port()}"
    client = OpenAIClient(url, retries=1, backoff_s=0.01)
    assert not client.healthy()
    with pytest.raises(ServerError, match="after 2 attempts"):
        client.request("/v1/completions", {"prompt": [1]})
    with pytest.raises(DFlashError, match="no model listed"):
        client.model()
    with pytest.raises(DFlashError, match="http:// or https://"):
        OpenAIClient("127.0.0.1:8000")


def test_metrics_sum_over_engines_and_keep_the_position(server):
    url, _ = server
    m = OpenAIClient(url).metrics()
    assert m == parse_metrics(METRICS)
    assert m["vllm:spec_decode_num_drafts_total"] == 19.0
    assert m["vllm:spec_decode_num_accepted_tokens_per_pos_total{position=0}"] == 9.0
    assert m["vllm:spec_decode_num_accepted_tokens_per_pos_total{position=1}"] == 3.0
