"""The HTTP door's own bounds, on the fake engine: request bodies are capped with or without a
Content-Length (a chunked upload is cut off as soon as it passes the limit, with OpenAI's error
body), and a slow grammar compile runs off the event loop (HTTP and gRPC), so other requests go
on streaming while it runs."""

from __future__ import annotations

import asyncio
import json
import socket
import threading

import httpx
import pytest

from jaxserve.engine.grammar import GrammarCompiler
from jaxserve.server.fake_engine import fake_generate, fake_tokenizer
from test_server_support import MODEL, base_url, http_server

LIMIT = 2000  # max_message_bytes of the server below
TOK = fake_tokenizer()


@pytest.fixture(scope="module")
def server():
    with http_server(server={"max_message_bytes": LIMIT}) as s:
        yield s


def body_of(prompt: str) -> bytes:
    return json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": 5, "seed": 1}).encode()


def chunks(data: bytes, size: int = 300):
    for i in range(0, len(data), size):
        yield data[i:i + size]


def assert_413(r: httpx.Response) -> None:
    assert r.status_code == 413, r.text
    err = r.json()["error"]
    assert err["param"] == "body" and f"limit of {LIMIT}" in err["message"] and err["type"] == "invalid_request_error"


def test_body_cap_with_and_without_content_length(server):
    url = base_url(server) + "/v1/completions"
    small, big = body_of("Hello"), body_of("x" * (2 * LIMIT))
    assert_413(httpx.post(url, content=big, headers={"content-type": "application/json"}))
    # A generator body goes out chunked, with no Content-Length.
    r = httpx.post(url, content=chunks(big), headers={"content-type": "application/json"})
    assert "content-length" not in r.request.headers and r.request.headers["transfer-encoding"] == "chunked"
    assert_413(r)
    # Within the limit a chunked body is read whole and handed on unchanged.
    r = httpx.post(url, content=chunks(small, 7), headers={"content-type": "application/json"})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == bytes(fake_generate(TOK.encode("Hello"), 5, seed=1)[0]).decode()


def test_chunked_body_is_refused_before_it_ends(server):
    """A client that never ends its chunked body gets its 413 once the limit is passed (the
    server does not wait for, or buffer, the rest)."""
    with socket.create_connection(("127.0.0.1", server.server.http_port), timeout=10) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Transfer-Encoding: chunked\r\n\r\n")
        piece = b"x" * 500
        for _ in range(LIMIT // len(piece) + 1):  # just past the limit, and no final 0-chunk
            sock.sendall(b"%x\r\n%s\r\n" % (len(piece), piece))
        reply = b""
        while b"\r\n\r\n" not in reply or not reply.rstrip().endswith(b"}"):
            got = sock.recv(65536)
            if not got:
                break
            reply += got
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 413"), reply[:200]
    assert json.loads(body[body.index(b"{"):body.rindex(b"}") + 1])["error"]["param"] == "body"


@pytest.fixture
def blocked_grammar(monkeypatch):
    """GrammarCompiler.check held until `release` is set; records whether it ran on an event
    loop's thread."""
    state = {"release": threading.Event(), "entered": threading.Event(), "on_loop": None}
    real = GrammarCompiler.check.__func__

    def slow_check(cls, sop):
        try:
            asyncio.get_running_loop()
            state["on_loop"] = True
        except RuntimeError:
            state["on_loop"] = False
        state["entered"].set()
        state["release"].wait(20)
        return real(cls, sop)
    monkeypatch.setattr(GrammarCompiler, "check", classmethod(slow_check))
    yield state
    state["release"].set()


def _other_request_completes_while_grammar_is_held(state, start_constrained, plain_request):
    results = {}
    t = threading.Thread(target=lambda: results.setdefault("constrained", start_constrained()))
    t.start()
    try:
        assert state["entered"].wait(10), "the grammar check never ran"
        # While the grammar is being "compiled", another request runs from start to finish. On
        # the event loop the check would hold every other request until it returned.
        plain_request()
        assert state["on_loop"] is False
    finally:
        state["release"].set()
        t.join(30)
    return results["constrained"]


def test_slow_grammar_does_not_stall_other_http_requests(server, blocked_grammar):
    url = base_url(server) + "/v1/completions"

    def constrained():
        return httpx.post(url, json={"model": MODEL, "prompt": "x", "max_tokens": 8, "guided_regex": "[0-9]{3}"},
                          timeout=30)

    def plain():
        with httpx.stream("POST", url, json={"model": MODEL, "prompt": "Hi", "max_tokens": 6, "stream": True},
                          timeout=5) as r:
            assert r.status_code == 200 and r.read().endswith(b"data: [DONE]\n\n")
    r = _other_request_completes_while_grammar_is_held(blocked_grammar, constrained, plain)
    assert r.status_code == 200 and len(r.json()["choices"][0]["text"]) == 3 and r.json()["choices"][0]["text"].isdigit()


def test_slow_grammar_does_not_stall_other_grpc_requests(server, blocked_grammar):
    from jaxserve.server.proto import generation_pb2 as pb
    from test_server_support import gen_stub
    stub = gen_stub(server)

    def constrained():
        return stub.GenerateUnary(pb.GenerateRequest(prompt="x", max_tokens=8, structured_outputs=pb.StructuredOutputs(
            regex="[0-9]{3}")), timeout=30)

    def plain():
        assert len(stub.GenerateUnary(pb.GenerateRequest(prompt="Hi", max_tokens=6, ignore_eos=True), timeout=5).completions[0].token_ids) == 6
    r = _other_request_completes_while_grammar_is_held(blocked_grammar, constrained, plain)
    assert r.completions[0].text.isdigit() and len(r.completions[0].text) == 3
