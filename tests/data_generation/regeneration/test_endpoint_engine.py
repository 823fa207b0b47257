"""The endpoint engine's protocol handling against a small local HTTP server: retries with
backoff, a refused request, a reply without token ids (a server other than vLLM). The real
`vllm serve` comparison is in test_regenerate_engine.py."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from speculators_vllm016.data_generation.regeneration import endpoint_engine
from speculators_vllm016.data_generation.regeneration.endpoint_engine import EndpointEngine
from speculators_vllm016.data_generation.regeneration.engines import TurnRequest
from speculators_vllm016.data_generation.regeneration.options import (
    RegenerateOptions,
    SamplingOptions,
)


class Script:
    """What the server answers, per prompt's first token: a list of (status, body) to pop."""

    def __init__(self):
        self.replies: dict[int, list[tuple[int, dict]]] = {}
        self.bodies: list[dict] = []


def _server(script: Script):
    class Handler(BaseHTTPRequestHandler):
        def _send(self, status: int, payload: dict) -> None:
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):  # noqa: N802 - http.server's name
            self._send(200, {"data": [{"id": "served"}]})

        def do_POST(self):  # noqa: N802 - http.server's name
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            script.bodies.append(body)
            self._send(*script.replies[body["prompt"][0]].pop(0))

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


@pytest.fixture
def served(monkeypatch):
    monkeypatch.setattr(endpoint_engine, "FIRST_BACKOFF_SECONDS", 0.01)
    script = Script()
    server = _server(script)
    yield script, f"http://127.0.0.1:{server.server_address[1]}/v1"
    server.shutdown()


def _choice(**fields) -> tuple[int, dict]:
    return 200, {"choices": [{"finish_reason": "length", **fields}]}


def test_retries_refusals_and_replies_without_token_ids(served):
    script, url = served
    script.replies = {
        1: [(503, {}), (429, {}), _choice(text="x", token_ids=[7, 8])],  # ok on the 3rd try
        2: [(503, {})] * 3,  # still failing after the retries
        3: [(400, {"error": "prompt too long"})],  # refused: not retried
        4: [_choice(text="plain text")],  # a server that sends no token ids
        5: [(200, {"choices": [{"text": "end", "token_ids": [9, 2], "finish_reason": "stop"}]})],
    }
    options = RegenerateOptions("model", "data.jsonl", "out", endpoint=url, retries=2)
    engine = EndpointEngine(options)
    assert engine.model == "served"
    sampling = SamplingOptions(temperature=0.5, max_tokens=4)
    answers = engine.respond(
        [TurnRequest([first, 0], seed=first) for first in range(1, 6)], sampling
    )
    assert answers[0].token_ids == [7, 8] and answers[0].error is None
    assert answers[1].retryable and "after 3 attempts (HTTP 503" in answers[1].error
    assert not answers[2].retryable and "HTTP 400" in answers[2].error
    assert answers[3].token_ids is None and answers[3].text == "plain text"
    assert answers[4].token_ids == [9]  # the stop token is not part of the turn
    # The requests run concurrently: the first row's body is found by its seed, not by arrival.
    body = next(b for b in script.bodies if b.get("seed") == 1)
    assert body["prompt"] == [1, 0] and body["seed"] == 1 and body["temperature"] == 0.5
    assert "top_p" not in body and "top_k" not in body  # unset: the server's generation config
    assert body["return_token_ids"] is True and body["model"] == "served"


def test_an_endpoint_that_does_not_answer_is_one_line():
    options = RegenerateOptions("model", "data.jsonl", "out", endpoint="http://127.0.0.1:9")
    with pytest.raises(RuntimeError, match="does not answer /v1/models"):
        EndpointEngine(options)
