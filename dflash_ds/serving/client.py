"""An OpenAI-compatible HTTP client (vLLM, SGLang, `transformers serve`): chat, completions on token ids, /metrics.

Standard library only (urllib), so it runs in the training environment beside any server. A
request that fails for a reason that may pass (connection refused or reset, a timeout, HTTP 5xx or
429) is retried with exponential backoff; anything else (HTTP 4xx: a bad request) fails at once.
"""

from __future__ import annotations

import json
import socket
import time
import urllib.error
import urllib.request
from dataclasses import dataclass

from dflash_ds.errors import DFlashError


class ServerError(Exception):
    """A request that failed for good (after its retries, or a 4xx the server will answer again)."""


@dataclass
class Answer:
    """One generated answer: its text, the reasoning part where the server splits it, the token ids, why it ended."""

    text: str
    reasoning: str | None
    token_ids: list[int] | None  # None where the server does not return them (vLLM does with return_token_ids)
    finish_reason: str  # "stop" | "length": an answer that ended otherwise is retried or refused (`_choice`)


class OpenAIClient:
    """Requests to one server at `url` (e.g. http://127.0.0.1:8000), retried with backoff."""

    def __init__(self, url: str, *, timeout_s: float = 600.0, retries: int = 4, backoff_s: float = 1.0,
                 api_key: str | None = None) -> None:
        if not url.startswith(("http://", "https://")):
            raise DFlashError(f"--server {url}: expected an http:// or https:// URL")
        self.url = url.rstrip("/").removesuffix("/v1")
        self.timeout_s, self.retries, self.backoff_s = timeout_s, retries, backoff_s
        self.headers = {"Content-Type": "application/json"}
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"
        self._model: str | None = None

    def _once(self, path: str, body: dict | None) -> bytes:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, headers=self.headers,
                                     method="GET" if body is None else "POST")
        with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
            return resp.read()

    def request(self, path: str, body: dict | None = None) -> bytes:
        """GET (no body) or POST JSON; retried while the failure may pass; ServerError when it does not."""
        wait = self.backoff_s
        for attempt in range(self.retries + 1):
            try:
                return self._once(path, body)
            except urllib.error.HTTPError as exc:
                detail = exc.read().decode(errors="replace")[:300]
                if exc.code < 500 and exc.code != 429:
                    raise ServerError(f"{self.url}{path}: HTTP {exc.code}: {detail}") from None
                error = f"HTTP {exc.code}: {detail}"
            except (urllib.error.URLError, ConnectionError, socket.timeout, TimeoutError) as exc:
                error = str(getattr(exc, "reason", exc))
            if attempt < self.retries:
                time.sleep(wait)
                wait *= 2
        raise ServerError(f"{self.url}{path}: {error} (after {self.retries + 1} attempts)")

    def post(self, path: str, body: dict) -> dict:
        """POST JSON, parse the JSON answer."""
        return json.loads(self.request(path, body))

    def healthy(self) -> bool:
        """Whether the server answers /health now (one try, short timeout)."""
        try:
            urllib.request.urlopen(self.url + "/health", timeout=5).read()
            return True
        except (urllib.error.URLError, ConnectionError, socket.timeout, TimeoutError):
            return False

    def model(self) -> str:
        """The served model's name (the first of /v1/models), which every request names."""
        if self._model is None:
            try:
                listed = json.loads(self.request("/v1/models"))["data"]
                self._model = listed[0]["id"]
            except (ServerError, KeyError, IndexError, ValueError) as exc:
                raise DFlashError(f"{self.url}/v1/models: no model listed ({exc})") from None
        return self._model

    def chat(self, messages: list[dict], *, max_tokens: int, temperature: float, top_p: float = 1.0,
             seed: int | None = None) -> Answer:
        """One chat completion; the token ids are asked for (vLLM: return_token_ids) and kept where returned."""
        body = {"model": self.model(), "messages": messages, "max_tokens": max_tokens, "temperature": temperature,
                "top_p": top_p, "return_token_ids": True, "skip_special_tokens": True}
        if seed is not None:
            body["seed"] = seed
        choice = self._choice("/v1/chat/completions", body)
        message = choice.get("message") or {}
        reasoning = message.get("reasoning_content") or message.get("reasoning")
        return Answer(message.get("content") or "", reasoning, choice.get("token_ids"),
                      choice.get("finish_reason") or "stop")

    def complete_ids(self, prompt: list[int], *, max_tokens: int, temperature: float = 0.0, top_p: float = 1.0,
                     seed: int | None = None, stop: list[str] | None = None) -> Answer:
        """One completion of a prompt given as token ids (no chat template applied by the server); `stop`: strings
        that end it (not included in the text)."""
        body = {"model": self.model(), "prompt": prompt, "max_tokens": max_tokens, "temperature": temperature,
                "top_p": top_p, "return_token_ids": True}
        if stop:
            body["stop"] = stop
        if seed is not None:
            body["seed"] = seed
        choice = self._choice("/v1/completions", body)
        return Answer(choice.get("text") or "", None, choice.get("token_ids"), choice.get("finish_reason") or "stop")

    def _choice(self, path: str, body: dict) -> dict:
        """The first choice of a whole answer. vLLM answers HTTP 200 with the partial text and finish_reason
        'abort' for a request it aborted (a server shutting down, paused, or its engine restarting): that is retried
        like a 5xx; another reason ('error', 'repetition') fails at once. Only 'stop' and 'length' (or none given)
        make a row: a partial answer must never be written as a finished one."""
        wait = self.backoff_s
        for attempt in range(self.retries + 1):
            choice = self.post(path, body)["choices"][0]
            reason = choice.get("finish_reason") or "stop"
            if reason in ("stop", "length"):
                return choice
            if reason != "abort":
                break
            if attempt < self.retries:
                time.sleep(wait)
                wait *= 2
        tries = f" (after {attempt + 1} attempts)" if reason == "abort" else ""
        raise ServerError(f"{self.url}{path}: the answer ended with finish_reason '{reason}', not 'stop' or "
                          f"'length'{tries}")

    def metrics(self) -> dict[str, float]:
        """Prometheus /metrics as {name or name{label=value}: value}, summed over the other labels."""
        return parse_metrics(self.request("/metrics").decode())


def parse_metrics(text: str, keep_label: str = "position") -> dict[str, float]:
    """Prometheus text -> {name: value} summed over label sets; a `keep_label` stays in the key: name{position=3}."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        head, _, value = line.rpartition(" ")
        name, _, labels = head.partition("{")
        key = name
        for part in labels.rstrip("}").split(","):
            if part.startswith(f"{keep_label}="):
                key = f"{name}{{{part.replace(chr(34), '')}}}"
        try:
            out[key] = out.get(key, 0.0) + float(value)
        except ValueError:
            continue
    return out
