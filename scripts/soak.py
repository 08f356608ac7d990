"""Soak a real `jaxserve serve` (started here, loopback only) under mixed load, then check that
nothing was lost.

    python scripts/soak.py --duration 600                       # the embedded SmolLM2
    python scripts/soak.py --fake-model --duration 60           # the fake model (the test suite)
    python scripts/soak.py --duration 600 --json soak.json -- --kv-cache-mb 256   # serve flags after --

Load: `--clients` threads, each looping until the duration ends (or `--max-requests` in all)
over a random action:
    stream / unary / jetstream   valid requests, random sampling settings, n in 1..3
    invalid                      one of the bad inputs of docs reliability.md (must be
                                 INVALID_ARGUMENT; raw invalid UTF-8 included)
    cancel                       a stream cancelled after its first message
    deadline                     a stream with a deadline shorter than its generation
    disconnect                   a stream whose channel is closed mid-stream
    tokenize                     Tokenize / Detokenize
and every `--kill-every` seconds a client process is started and SIGKILLed mid-stream.
RESOURCE_EXHAUSTED (the queue bound) is an allowed answer to any admitted kind.

At the end (after the load stops and the server had `--settle` seconds):
  - no INTERNAL and no UNKNOWN answer, and every invalid request got INVALID_ARGUMENT;
  - every admitted request ended: jaxserve_num_requests_running, _waiting and kv_pages_used are 0,
    and the server counted no `internal` outcome;
  - the server's resident memory grew less than 5% from the end of warm-up (the first third of
    the run) to the end;
  - the server is still live and serving.
It prints a summary table, writes it as JSON (`--json`), and exits 0 only if every check holds.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import grpc

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from jaxserve.server.proto import generation_grpc, jetstream_grpc  # noqa: E402
from jaxserve.server.proto import generation_pb2 as pb  # noqa: E402
from jaxserve.server.proto import jetstream_pb2 as js  # noqa: E402

BAD_CODES = {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN}
WORDS = "the capital of France is Paris and 日本語 🙂 once upon a time there was a little".split()


def rss_kb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for pid {pid}")


def metrics(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


class Server:
    """`jaxserve serve --port 0 --metrics-port 0` as a child process; waits for "ready"."""

    def __init__(self, fake: bool, extra: list[str], ready_timeout: float):
        cmd = [sys.executable, "-m", "jaxserve.cli", "serve", "--host", "127.0.0.1", "--port", "0",
               "--metrics-port", "0", "--no-progress"]
        if fake:
            cmd += ["--fake-model", "--fake-step-delay", "0.005"]
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT)}
        self.proc = subprocess.Popen(cmd + extra, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        end = time.monotonic() + ready_timeout
        self.port = self.metrics_port = None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip())
            if line.startswith("jaxserve: listening on"):
                self.port = int(line.split(":")[2].split()[0])
                self.metrics_port = int(line.rsplit(":", 1)[1].split("/")[0])
            if line.startswith("jaxserve: ready"):
                break
            if time.monotonic() > end:
                break
        if self.port is None or not self.lines or not self.lines[-1].startswith("jaxserve: ready"):
            self.stop()
            raise RuntimeError("the server did not start:\n" + "\n".join(self.lines[-30:]))
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self):
        for line in self.proc.stdout:
            self.lines.append(line.rstrip())

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def stop(self) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                return self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        return self.proc.wait()


class Load:
    def __init__(self, address: str, info: pb.ModelInfoResponse, seed: int):
        self.address = address
        self.V = info.vocab_size
        self.ctx = info.context_length
        self.rng = random.Random(seed)
        self.lock = threading.Lock()
        self.codes: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        self.latency: dict[str, list[float]] = collections.defaultdict(list)
        self.violations: list[str] = []
        self.requests = 0

    def record(self, kind: str, code: grpc.StatusCode, seconds: float, detail: str = "") -> None:
        with self.lock:
            self.codes[kind][code.name] += 1
            self.latency[kind].append(seconds)
            if code in BAD_CODES:
                self.violations.append(f"{kind}: {code.name}: {detail[:300]}")
            if kind == "invalid" and code not in (grpc.StatusCode.INVALID_ARGUMENT,):
                self.violations.append(f"invalid input answered {code.name}: {detail[:300]}")

    # ---- requests --------------------------------------------------------------------------

    def prompt(self, rng) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 12)))

    def valid(self, rng) -> pb.GenerateRequest:
        req = pb.GenerateRequest(max_tokens=rng.randint(1, 24), n=rng.choice([1, 1, 1, 2, 3]))
        form = rng.random()
        if form < 0.6:
            req.prompt = self.prompt(rng)
        elif form < 0.8:
            req.messages.messages.add(role="user", content=self.prompt(rng))
        else:
            req.prompt_token_ids.ids.extend(rng.randrange(self.V) for _ in range(rng.randint(1, 16)))
        if rng.random() < 0.5:
            req.temperature = rng.choice([0.5, 1.0, 1.3])
            req.top_p = rng.choice([0.8, 1.0])
            req.top_k = rng.choice([0, 5, 50, 2**31 - 1])
            req.seed = rng.randrange(2**63)
        if rng.random() < 0.2:
            req.stop.extend(rng.sample(WORDS, 2))
        if rng.random() < 0.2:
            req.logprobs = rng.randint(0, 5)
        if rng.random() < 0.1:
            req.repetition_penalty = 1.2
        return req

    def invalid(self, rng):
        """(request or raw bytes, what it is)."""
        cases = [
            (pb.GenerateRequest(prompt=""), "empty prompt"),
            (pb.GenerateRequest(prompt="x", max_tokens=0), "max_tokens 0"),
            (pb.GenerateRequest(prompt="x", max_tokens=2**31), "max_tokens 2^31"),
            (pb.GenerateRequest(prompt="x", temperature=float("nan")), "temperature NaN"),
            (pb.GenerateRequest(prompt="x", temperature=-0.1), "temperature -0.1"),
            (pb.GenerateRequest(prompt="x", top_p=1.0001), "top_p 1.0001"),
            (pb.GenerateRequest(prompt="x", top_k=2**31), "top_k 2^31"),
            (pb.GenerateRequest(prompt="x", top_k=-2), "top_k -2"),
            (pb.GenerateRequest(prompt="x", seed=-1), "seed -1"),
            (pb.GenerateRequest(prompt="x", n=0), "n 0"),
            (pb.GenerateRequest(prompt="x", n=10**6), "n 10^6"),
            (pb.GenerateRequest(prompt="x", logprobs=21), "logprobs 21"),
            (pb.GenerateRequest(prompt="x", stop=[""]), "empty stop string"),
            (pb.GenerateRequest(prompt="x", stop=["s"] * 1000), "1000 stop strings"),
            (pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=[1, self.V])), "token id = vocab"),
            (pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=[-1])), "token id -1"),
            (pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=[1] * (self.ctx + 1))), "prompt of context + 1"),
            (pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=[1] * (self.ctx - 2)), max_tokens=10),
             "prompt + max_tokens over the context"),
            (pb.GenerateRequest(messages=pb.ChatMessages(messages=[pb.ChatMessage(role="r" * 100_000, content="x")])),
             "100k-character role"),
            (pb.GenerateRequest(messages=pb.ChatMessages(messages=[pb.ChatMessage(role="user")] * 5000)),
             "5000 messages"),
            (pb.GenerateRequest(prompt="x" * 1_000_001), "1M+1-character prompt"),
            (pb.GenerateRequest(prompt="x", request_id="r" * 300), "300-character request id"),
            (b"\x12\x03\xff\xfe\xfd", "invalid UTF-8 in the prompt (raw bytes)"),
            (b"\xff\xff\xff", "unparsable message (raw bytes)"),
        ]
        return rng.choice(cases)

    # ---- actions ---------------------------------------------------------------------------

    def run_one(self, kind: str, channel: grpc.Channel, rng) -> None:
        stub = generation_grpc.GenerationStub(channel)
        t0 = time.perf_counter()
        code, detail = grpc.StatusCode.OK, ""
        try:
            if kind == "stream":
                for _ in stub.Generate(self.valid(rng), timeout=120):
                    pass
            elif kind == "unary":
                stub.GenerateUnary(self.valid(rng), timeout=120)
            elif kind == "jetstream":
                req = js.DecodeRequest(max_tokens=rng.randint(1, 16), num_samples=rng.choice([0, 1, 2]))
                if rng.random() < 0.5:
                    req.text_content.text = self.prompt(rng)
                else:
                    req.token_content.token_ids.extend(rng.randrange(self.V) for _ in range(4))
                for _ in jetstream_grpc.OrchestratorStub(channel).Decode(req, timeout=120):
                    pass
            elif kind == "invalid":
                req, detail = self.invalid(rng)
                if isinstance(req, bytes):
                    call = channel.unary_unary("/jaxserve.v1.Generation/GenerateUnary",
                                               request_serializer=lambda b: b, response_deserializer=lambda b: b)
                    call(req, timeout=30)
                else:
                    stub.GenerateUnary(req, timeout=30)
            elif kind == "cancel":
                stream = stub.Generate(self.valid(rng), timeout=120)
                next(stream, None)
                stream.cancel()
                code = grpc.StatusCode.CANCELLED
            elif kind == "deadline":
                req = self.valid(rng)
                req.max_tokens = 200
                req.ignore_eos = True
                for _ in stub.Generate(req, timeout=rng.uniform(0.05, 0.5)):
                    pass
            elif kind == "tokenize":
                ids = stub.Tokenize(pb.TokenizeRequest(text=self.prompt(rng)), timeout=30).token_ids
                stub.Detokenize(pb.DetokenizeRequest(token_ids=ids), timeout=30)
            else:
                raise ValueError(kind)
        except grpc.RpcError as e:
            code, detail = e.code(), f"{detail} {e.details()}"
            if kind == "cancel" and code == grpc.StatusCode.CANCELLED:
                pass
        self.record(kind, code, time.perf_counter() - t0, detail)

    def disconnect(self, rng) -> None:
        """A stream whose channel is closed under it (the server sees the client go away)."""
        ch = grpc.insecure_channel(self.address)
        t0 = time.perf_counter()
        stream = generation_grpc.GenerationStub(ch).Generate(self.valid(rng), timeout=120)
        try:
            next(stream, None)
        except grpc.RpcError as e:
            self.record("disconnect", e.code(), time.perf_counter() - t0, e.details())
            ch.close()
            return
        ch.close()
        self.record("disconnect", grpc.StatusCode.CANCELLED, time.perf_counter() - t0)

    def worker(self, index: int, end: float, max_requests: int, pause: float) -> None:
        rng = random.Random(self.rng.random() + index)
        channel = grpc.insecure_channel(self.address, options=[("grpc.max_send_message_length", 64 * 2**20)])
        kinds = (["stream"] * 5 + ["unary"] * 3 + ["jetstream"] * 2 + ["invalid"] * 4 + ["cancel"] * 2
                 + ["deadline"] * 2 + ["tokenize"] + ["disconnect"])
        while time.monotonic() < end:
            with self.lock:
                if self.requests >= max_requests:
                    break
                self.requests += 1
            kind = rng.choice(kinds)
            if kind == "disconnect":
                self.disconnect(rng)
            else:
                self.run_one(kind, channel, rng)
            time.sleep(pause)
        channel.close()

    def killer(self, end: float, every: float) -> None:
        """Every `every` seconds: a client process streaming a long answer, SIGKILLed mid-stream."""
        code = ("import sys, grpc; sys.path.insert(0, %r)\n"
                "from jaxserve.server.proto import generation_grpc, generation_pb2 as pb\n"
                "s = generation_grpc.GenerationStub(grpc.insecure_channel(%r))\n"
                "for m in s.Generate(pb.GenerateRequest(prompt='kill me', max_tokens=200, ignore_eos=True)):\n"
                "    print('got', flush=True)\n") % (str(ROOT), self.address)
        while time.monotonic() + every < end:
            time.sleep(every)
            p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                 text=True)
            t0 = time.perf_counter()
            p.stdout.readline()  # its first message: the request is admitted and running
            p.kill()
            p.wait()
            self.record("killed", grpc.StatusCode.CANCELLED, time.perf_counter() - t0)


def percentile(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--duration", type=float, default=600.0, help="seconds of load (default 600)")
    p.add_argument("--max-requests", type=int, default=1_000_000, help="stop after this many requests")
    p.add_argument("--clients", type=int, default=8, help="client threads")
    p.add_argument("--pause", type=float, default=0.0, help="seconds each client waits between requests")
    p.add_argument("--kill-every", type=float, default=15.0, help="seconds between killed client processes")
    p.add_argument("--settle", type=float, default=10.0, help="seconds the server gets to go idle at the end")
    p.add_argument("--fake-model", action="store_true", help="serve the fake model (no weights, little CPU)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None, help="write the summary here")
    p.add_argument("--ready-timeout", type=float, default=600.0)
    p.add_argument("serve_args", nargs="*", help="extra `jaxserve serve` flags (after --)")
    args = p.parse_args(argv)
    if args.duration <= 0 or args.max_requests < 1 or args.clients < 1:
        p.error("--duration, --max-requests and --clients must be positive")

    server = Server(args.fake_model, args.serve_args, args.ready_timeout)
    checks: dict[str, bool] = {}
    try:
        info = generation_grpc.GenerationStub(grpc.insecure_channel(server.address)).ModelInfo(
            pb.ModelInfoRequest(), timeout=30)
        load = Load(server.address, info, args.seed)
        t0 = time.monotonic()
        end = t0 + args.duration
        warm_at = t0 + args.duration / 3
        rss: list[tuple[float, int]] = []
        threads = [threading.Thread(target=load.worker, args=(i, end, args.max_requests, args.pause), daemon=True)
                   for i in range(args.clients)]
        threads.append(threading.Thread(target=load.killer, args=(end, args.kill_every), daemon=True))
        for t in threads:
            t.start()
        while any(t.is_alive() for t in threads) and time.monotonic() < end + 180:
            rss.append((time.monotonic() - t0, rss_kb(server.proc.pid)))
            time.sleep(1.0)
        hung = sum(t.is_alive() for t in threads)
        # Settle: everything admitted must end, pages and gauges return to 0.
        deadline = time.monotonic() + args.settle
        while True:
            m = metrics(server.metrics_port)
            idle = (m.get("jaxserve_num_requests_running", -1) == 0 and m.get("jaxserve_num_requests_waiting", -1) == 0
                    and m.get("jaxserve_kv_pages_used", -1) == 0)
            if idle or time.monotonic() > deadline:
                break
            time.sleep(0.25)
        rss.append((time.monotonic() - t0, rss_kb(server.proc.pid)))
        warm = next((kb for s, kb in rss if s >= warm_at - t0), rss[0][1])
        growth = (rss[-1][1] - warm) / warm
        outcomes = {k.split('outcome="')[1].rstrip('"}'): v for k, v in m.items()
                    if k.startswith("jaxserve_finished_requests_total{")}
        health = grpc.insecure_channel(server.address)
        from grpc_health.v1 import health_pb2, health_pb2_grpc
        live = health_pb2_grpc.HealthStub(health).Check(health_pb2.HealthCheckRequest(service="liveness"),
                                                         timeout=10).status == health_pb2.HealthCheckResponse.SERVING
        after = generation_grpc.GenerationStub(health).GenerateUnary(
            pb.GenerateRequest(prompt="still serving?", max_tokens=2), timeout=60)
        checks = {
            "no INTERNAL or UNKNOWN, invalid inputs INVALID_ARGUMENT": not load.violations,
            "every client call returned": hung == 0,
            "running, waiting and KV pages back to 0": idle,
            "no request ended `internal` in the server's count": outcomes.get("internal", 0) == 0,
            "RSS growth after warm-up < 5%": growth < 0.05,
            "still live and serving": live and bool(after.completions),
        }
        summary = {
            "duration_s": round(time.monotonic() - t0, 1), "requests": load.requests,
            "model": "fake" if args.fake_model else "default (SmolLM2)", "clients": args.clients,
            "codes": {k: dict(v) for k, v in sorted(load.codes.items())},
            "latency_s": {k: {"p50": round(percentile(v, 0.5), 3), "p99": round(percentile(v, 0.99), 3)}
                          for k, v in sorted(load.latency.items())},
            "server_outcomes": outcomes,
            "final_gauges": {k: m.get(f"jaxserve_{k}") for k in ("num_requests_running", "num_requests_waiting",
                                                                 "kv_pages_used", "kv_pages_total",
                                                                 "compilations_after_warmup")},
            "rss_mb": {"start": round(rss[0][1] / 1024, 1), "after_warmup": round(warm / 1024, 1),
                       "end": round(rss[-1][1] / 1024, 1), "growth_after_warmup_pct": round(100 * growth, 2)},
            "violations": load.violations[:50],
            "checks": checks,
        }
    finally:
        code = server.stop()
    summary["server_exit_status"] = code
    checks["server drained and exited 0"] = code == 0
    ok = all(checks.values())
    summary["ok"] = ok
    print_table(summary)
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2) + "\n")
    return 0 if ok else 1


def print_table(s: dict) -> None:
    names = sorted({c for v in s["codes"].values() for c in v})
    print(f"soak: {s['duration_s']} s, {s['requests']} requests, {s['clients']} clients, model {s['model']}")
    print(f"{'kind':<12}" + "".join(f"{n:>20}" for n in names) + f"{'p50 s':>9}{'p99 s':>9}")
    for kind, codes in s["codes"].items():
        lat = s["latency_s"][kind]
        print(f"{kind:<12}" + "".join(f"{codes.get(n, 0):>20}" for n in names) + f"{lat['p50']:>9}{lat['p99']:>9}")
    print(f"server outcomes: {s['server_outcomes']}")
    print(f"final gauges: {s['final_gauges']}")
    r = s["rss_mb"]
    print(f"server RSS MB: start {r['start']}, after warm-up {r['after_warmup']}, end {r['end']} "
          f"({r['growth_after_warmup_pct']:+.2f}%)")
    for v in s["violations"][:10]:
        print(f"VIOLATION {v}")
    for name, ok in s["checks"].items():
        print(f"[{'ok' if ok else 'FAIL'}] {name}")
    print(f"server exit status {s['server_exit_status']}")
    print("SOAK " + ("PASSED" if s["ok"] else "FAILED"))


if __name__ == "__main__":
    sys.exit(main())
