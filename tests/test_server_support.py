"""Helpers shared by the tests/test_server_*.py modules (this module holds no tests).

A real server on 127.0.0.1 with port 0 and real grpc clients; the engine is the real Engine
over jaxserve.server.fake_engine's hand-computable model unless a test says otherwise.
"""

from __future__ import annotations

import contextlib
import re
import shutil
import subprocess
import threading
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from jaxserve.server.app import BackgroundServer
from jaxserve.server.config import ServerConfig
from jaxserve.server.fake_engine import make_fake_engine
from jaxserve.server.generation_service import ModelDescription
from jaxserve.server.proto import generation_grpc, jetstream_grpc
from jaxserve.server.proto import generation_pb2 as pb
from jaxserve.types import SamplingParams

FIELD_KEY = "jaxserve-field"


@contextlib.contextmanager
def fake_server(step_delay_s: float = 0.0, warmup_s: float | threading.Event = 0.0, on_step=None,
                ready: bool = True, server: dict | None = None, description: ModelDescription | None = None,
                **engine_kw):
    """Yields a started BackgroundServer over a fresh fake engine (`s.server.engine`). warmup_s:
    seconds, or an Event that ends the warm-up when the test sets it (set on the way out too)."""
    # No strict_compiles here: the fake never compiles, and the check counts compilations
    # process-wide, so a jax call elsewhere in the test process would trip it.
    engine = make_fake_engine(warmup_s=warmup_s, step_delay_s=step_delay_s, **engine_kw)
    cfg = ServerConfig(**{"port": 0, "progress": False, **(server or {})})
    s = BackgroundServer(engine, cfg, description=description, on_step=on_step)
    s.start(ready_timeout=30.0 if ready else None)
    try:
        yield s
    finally:
        end_warmup(warmup_s)
        s.stop()


# ---- the OpenAI-compatible HTTP door (tests/test_openai_*.py and the other HTTP tests) ------------

MODEL = "fake"   # the model name the HTTP servers below describe themselves by
TOKEN = "secret-token-123"


def http_server(server: dict | None = None, **kw):
    """fake_server with the HTTP door on (a free port) and the model named MODEL."""
    return fake_server(server={"http_port": 0, **(server or {})}, description=ModelDescription(MODEL), **kw)


def base_url(s: BackgroundServer) -> str:
    return f"http://127.0.0.1:{s.server.http_port}"


def metric(s, name: str, labels: str = "", text: str | None = None) -> float:
    """One sample's value from /metrics (or from `text`, one scrape read several times)."""
    import httpx
    text = text if text is not None else httpx.get(base_url(s) + "/metrics").text
    m = re.search(rf"^{re.escape(name + labels)} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def end_warmup(warmup_s) -> None:
    """A warm-up a test holds with an Event ends when the test does (stop() waits it out)."""
    if isinstance(warmup_s, threading.Event):
        warmup_s.set()


def channel(s: BackgroundServer) -> grpc.Channel:
    return grpc.insecure_channel(s.address, options=[("grpc.max_send_message_length", 64 * 2**20)])


def gen_stub(s) -> generation_grpc.GenerationStub:
    return generation_grpc.GenerationStub(channel(s))


def js_stub(s) -> jetstream_grpc.OrchestratorStub:
    return jetstream_grpc.OrchestratorStub(channel(s))


def health(s, service: str = "") -> int:
    stub = health_pb2_grpc.HealthStub(channel(s))
    return stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status


SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def wait_until(pred, timeout: float = 10.0, what: str = "condition") -> None:
    end = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > end:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.005)


def check_stream(msgs: list[pb.GenerateResponse], n: int = 1) -> dict[int, str]:
    """A finished stream's shape: each sample ends exactly once with nothing after its end, and
    exactly one message - the last - carries usage. Returns the joined text per sample."""
    assert msgs, "an OK stream must carry at least its final message"
    ended: set[int] = set()
    texts = {i: "" for i in range(n)}
    tokens = 0
    for i, m in enumerate(msgs):
        assert m.index not in ended, f"message for sample {m.index} after its final message"
        texts[m.index] += m.text
        tokens += len(m.token_ids)
        if m.finish_reason:
            ended.add(m.index)
        assert m.HasField("usage") == (i == len(msgs) - 1), "usage must be on the last message only"
    assert ended == set(range(n)), f"samples {set(range(n)) - ended} never finished"
    assert msgs[-1].usage.completion_tokens == tokens
    return texts


def code_and_field(err: grpc.RpcError) -> tuple[grpc.StatusCode, str | None]:
    md = dict(err.trailing_metadata() or ())
    return err.code(), md.get(FIELD_KEY)


def on_loop(s: BackgroundServer, fn):
    """Run `fn()` on the server's event loop (where the frontend lives) and return its value."""
    async def run():
        return fn()
    return s.call(run(), timeout=10)


def find_request_id(s: BackgroundServer, client_id: str, timeout: float = 10.0) -> str:
    """The server's (engine's) id of the in-flight request the client called `client_id`."""
    found: list[str] = []

    def look():
        subs = on_loop(s, lambda: [sub.request_id for sub in s.server.frontend._live.values()
                                   if sub.client_id == client_id])
        found[:] = subs
        return bool(subs)
    wait_until(look, timeout, f"request {client_id!r} to be accepted")
    return found[0]


def aborted(s: BackgroundServer, request_id: str) -> tuple[int, int] | None:
    """(engine steps when the abort was asked, steps when it was done), or None yet."""
    for rid, asked, done in list(s.server.engine_loop.abort_log):
        if rid == request_id:
            return asked, done
    return None


def wait_idle(s: BackgroundServer, timeout: float = 10.0) -> None:
    """Wait until nothing is in flight, then check reliability.md's "nothing lost": every page
    free, the engine's maps empty, every accepted request ended exactly once."""
    el, fe, lim = s.server.engine_loop, s.server.frontend, s.server.limiter
    # The queue limiter is in the condition, not only asserted after it: a cancel's abort (and
    # even its add) may still sit in the engine thread's inbox when the frontend is already
    # idle; the engine thread releases the reservation when it handles them. A reservation
    # that is never released still fails here, as a timeout that says what it holds.
    wait_until(lambda: on_loop(s, lambda: fe.num_live == 0 and fe.inflight == 0)
               and el.num_waiting_here == 0 and not el.engine.has_unfinished()
               and lim.queued_samples == 0 and lim.queued_tokens == 0, timeout,
               "idle (or a queue reservation that was never released)")
    eng = el.engine
    eng.scheduler.check_idle_invariant()
    assert eng.scheduler.num_free_pages == eng.scheduler.num_total_pages - 1
    assert not eng.finished_outputs, f"finished outputs never popped: {list(eng.finished_outputs)}"
    assert s.server.limiter.queued_samples == 0 and s.server.limiter.queued_tokens == 0
    st = fe.stats
    assert st["accepted"] == st["terminal"], st


# ---- certificates ------------------------------------------------------------------------------

def make_certs(folder: Path) -> dict[str, Path]:
    """A CA, a server certificate for localhost / 127.0.0.1 and a client certificate it signed,
    plus a second CA's client certificate (for "wrong CA" cases). With the `cryptography`
    package if present, else the openssl command."""
    try:
        import cryptography  # noqa: F401
    except ImportError:
        return _make_certs_openssl(folder)
    return _make_certs_cryptography(folder)


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def _make_certs_openssl(d: Path) -> dict[str, Path]:
    if shutil.which("openssl") is None:
        import pytest
        pytest.skip("neither the cryptography package nor the openssl command is available")
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    (d / "server.ext").write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\n"
                                  "extendedKeyUsage=serverAuth\n")
    (d / "client.ext").write_text("extendedKeyUsage=clientAuth\n")
    for ca in ("ca", "other_ca"):
        _openssl("req", "-x509", *ec, "-keyout", f"{ca}.key", "-out", f"{ca}.pem", "-days", "2",
                 "-subj", f"/CN=jaxserve test {ca}", cwd=d)
    for name, ca in (("server", "ca"), ("client", "ca"), ("other_client", "other_ca")):
        ext = "server.ext" if name == "server" else "client.ext"
        cn = "localhost" if name == "server" else name
        _openssl("req", *ec, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={cn}", cwd=d)
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key",
                 "-CAcreateserial", "-out", f"{name}.pem", "-days", "2", "-extfile", ext, cwd=d)
    return {k: d / k for k in ("ca.pem", "server.pem", "server.key", "client.pem", "client.key",
                               "other_client.pem", "other_client.key")}


def _make_certs_cryptography(d: Path) -> dict[str, Path]:
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.timezone.utc)

    def name(cn):
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    def cert(subject, key, issuer, issuer_key, exts):
        b = (x509.CertificateBuilder().subject_name(name(subject)).issuer_name(name(issuer))
             .public_key(key.public_key()).serial_number(x509.random_serial_number())
             .not_valid_before(now - datetime.timedelta(minutes=5))
             .not_valid_after(now + datetime.timedelta(days=2)))
        for ext, critical in exts:
            b = b.add_extension(ext, critical)
        return b.sign(issuer_key, hashes.SHA256())

    def write(stem, key, crt):
        (d / f"{stem}.key").write_bytes(key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
        (d / f"{stem}.pem").write_bytes(crt.public_bytes(serialization.Encoding.PEM))

    cas = {}
    for ca in ("ca", "other_ca"):
        key = ec.generate_private_key(ec.SECP256R1())
        crt = cert(f"jaxserve test {ca}", key, f"jaxserve test {ca}", key,
                   [(x509.BasicConstraints(ca=True, path_length=None), True)])
        write(ca, key, crt)
        cas[ca] = (key, f"jaxserve test {ca}")
    leaf = [("server", "ca", [(x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                            x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False),
                              (x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), False)]),
            ("client", "ca", [(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), False)]),
            ("other_client", "other_ca", [(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), False)])]
    for stem, ca, exts in leaf:
        key = ec.generate_private_key(ec.SECP256R1())
        ca_key, ca_name = cas[ca]
        write(stem, key, cert("localhost" if stem == "server" else stem, key, ca_name, ca_key, exts))
    return {k: d / k for k in ("ca.pem", "server.pem", "server.key", "client.pem", "client.key",
                               "other_client.pem", "other_client.key")}


def offline(prompt, params: SamplingParams):
    """The same request on a fresh fake engine driven directly (the offline API's loop)."""
    eng = make_fake_engine()
    rid = eng.add_request(prompt, params)
    while eng.has_unfinished():
        eng.step()
    return eng.pop_finished(rid)
