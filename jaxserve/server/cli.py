"""`jaxserve serve` and `jaxserve client`, added to the main parser by jaxserve/cli.py.

Nothing heavy is imported at module level: building the parser must stay instant.
"""

from __future__ import annotations

import argparse
import os
import sys

TOKEN_ENV = "JAXSERVE_AUTH_TOKEN"


def _read_token(path: str | None) -> str | None:
    """From a file (never a flag value: argv is visible to every user in `ps`), else the env."""
    if path:
        with open(path, encoding="utf-8") as f:
            return f.read().strip()
    return os.environ.get(TOKEN_ENV) or None


def _buckets(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def add_server_commands(sub) -> None:
    s = sub.add_parser("serve", help="serve the gRPC API (jaxserve.v1.Generation, JetStream's "
                                     "Orchestrator, health, reflection)")
    from jaxserve.model_args import add_model_args
    add_model_args(s)
    s.add_argument("--fake-model", action="store_true",
                   help="serve a hash-based fake model with a byte tokenizer instead (no weights, no "
                        "compilation): for client development and load tests of the server itself")
    s.add_argument("--fake-step-delay", type=float, default=0.0, metavar="SECONDS",
                   help="with --fake-model: sleep this long per engine step")
    s.add_argument("--fake-fail-from-step", type=int, default=None, metavar="N",
                   help="with --fake-model: every step from the N-th on raises, as on a device that "
                        "is gone (tests of the unrecoverable-fault exit)")
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    s.add_argument("--port", type=int, default=50051, help="0 = any free port (printed)")
    s.add_argument("--http-port", type=int, default=None,
                   help="also serve the OpenAI-compatible HTTP API (/v1/completions, "
                        "/v1/chat/completions, /v1/models, /health, /ready, /metrics) on this port, "
                        "with the same queue, token and TLS; 0 = any free port (printed)")
    s.add_argument("--no-grpc", action="store_true", help="serve HTTP only (needs --http-port)")
    s.add_argument("--served-model-name", default=None,
                   help="the model name clients send in OpenAI requests (default: the model's file "
                        "or folder name; 'fake' with --fake-model)")
    s.add_argument("--max-queued-requests", type=int, default=256,
                   help="samples waiting to run before RESOURCE_EXHAUSTED")
    s.add_argument("--max-queued-tokens", type=int, default=262_144,
                   help="prompt tokens waiting to run before RESOURCE_EXHAUSTED")
    s.add_argument("--grace-period", type=float, default=30.0, metavar="SECONDS",
                   help="SIGTERM: time in-flight requests get to finish")
    s.add_argument("--stall-timeout", type=float, default=120.0, metavar="SECONDS",
                   help="a step running longer turns health NOT_SERVING")
    s.add_argument("--max-consecutive-step-faults", type=int, default=3, metavar="N",
                   help="a failed step fails the requests it blames and serving goes on; N in a row "
                        "mean the device is gone: liveness NOT_SERVING and exit status 1")
    s.add_argument("--metrics-port", type=int, default=None,
                   help="serve Prometheus /metrics over HTTP on this port")
    s.add_argument("--metrics-host", default="127.0.0.1", help="address for /metrics")
    s.add_argument("--tls-cert", help="server certificate chain (PEM); enables TLS")
    s.add_argument("--tls-key", help="server private key (PEM)")
    s.add_argument("--tls-client-ca", help="require client certificates signed by this CA (mTLS)")
    s.add_argument("--auth-token-file", help=f"require 'authorization: Bearer <token>' (token read "
                                             f"from this file; or set {TOKEN_ENV})")
    s.add_argument("--max-model-len", type=int, default=None)
    s.add_argument("--max-num-seqs", type=int, default=64)
    s.add_argument("--max-num-batched-tokens", type=int, default=512,
                   help="tokens per step (the prefill chunk budget)")
    s.add_argument("--kv-cache-mb", type=int, default=512)
    s.add_argument("--token-buckets", type=_buckets, default=None, help="e.g. 1,8,64,512")
    s.add_argument("--num-speculative-tokens", type=int, default=0,
                   help="n-gram speculative decoding: up to this many draft tokens per greedy decode (0 = off)")
    s.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse the KV pages of prompt prefixes seen before; each tenant (bearer "
                        "token or client certificate) has its own cache namespace (default: on)")
    add_policy_args(s)
    s.add_argument("--compilation-cache-dir", default="~/.cache/jaxserve/xla",
                   help="persistent XLA cache ('' = none)")
    s.add_argument("--no-progress", action="store_true", help="no warm-up progress bar")
    _add_parallel_args(s)
    s.set_defaults(run=cmd_serve)

    c = sub.add_parser("client", help="stream an answer from a running `jaxserve serve`")
    c.add_argument("prompt")
    c.add_argument("--server", default="localhost:50051")
    c.add_argument("--chat", action="store_true", help="send the prompt as one user chat turn")
    c.add_argument("--max-tokens", type=int, default=256)
    c.add_argument("--temperature", type=float, default=None)
    c.add_argument("--top-p", type=float, default=None)
    c.add_argument("--top-k", type=int, default=None)
    c.add_argument("--seed", type=int, default=None)
    c.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")
    c.add_argument("--timeout", type=float, default=None, metavar="SECONDS", help="gRPC deadline")
    c.add_argument("--tls", action="store_true", help="TLS with the system's root certificates")
    c.add_argument("--tls-ca", help="trust this CA (PEM) instead")
    c.add_argument("--tls-cert", help="client certificate (mTLS)")
    c.add_argument("--tls-key", help="client key (mTLS)")
    c.add_argument("--auth-token-file", help=f"bearer token file (or set {TOKEN_ENV})")
    c.add_argument("--stats", action="store_true", help="print usage and timings to stderr")
    c.set_defaults(run=cmd_client)


def _tenant_weights(text: str) -> tuple[tuple[str, float], ...]:
    out = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, sep, w = part.rpartition("=")
        try:
            out.append((name, float(w)))
        except ValueError:
            sep = ""
        if not sep or not name:
            raise argparse.ArgumentTypeError(f"expected TENANT=WEIGHT[,...], got {part!r}")
    return tuple(out)


def add_policy_args(s) -> None:
    g = s.add_argument_group("scheduling policy (jaxserve/scheduler/policy.py)")
    g.add_argument("--scheduling-policy", choices=("fcfs", "priority"), default="fcfs",
                   help="fcfs: arrival order (request priority ignored); priority: lower value "
                        "first, preempting lower-priority running requests (default: fcfs)")
    g.add_argument("--priority-aging-rate", type=float, default=0.0, metavar="LEVELS_PER_STEP",
                   help="with --scheduling-policy priority: priority levels a request gains per "
                        "engine step it has waited, so low priorities are served eventually")
    g.add_argument("--fair-share", action="store_true",
                   help="share step tokens fairly between tenants (bearer token / client "
                        "certificate) instead of arrival order across tenants")
    g.add_argument("--tenant-weights", type=_tenant_weights, default=(), metavar="TENANT=W,...",
                   help="fair-share weights (tenant ids as the server logs them; others weigh 1)")
    g.add_argument("--slo-ttft-ms", type=float, default=None, metavar="MS",
                   help="SLO-aware admission: refuse (RESOURCE_EXHAUSTED, with a retry hint) a request "
                        "whose predicted time to first token exceeds this, instead of admitting it to "
                        "miss it (default: off)")
    g.add_argument("--slo-tpot-ms", type=float, default=None, metavar="MS",
                   help="hold a time-per-output-token target: cap each step's tokens (prefill "
                        "chunks) and the running batch to what the measured step cost fits in it; "
                        "requests beyond it wait in the queue, none is refused for it (default: off)")
    q = s.add_argument_group("per-tenant limits (jaxserve/scheduler/quotas.py; 0 = unlimited)")
    for name, what in (("max-concurrent", "requests in flight"),
                       ("max-queued", "requests waiting for their first token"),
                       ("tokens-per-minute", "prompt + output tokens a minute (token bucket)"),
                       ("max-prompt-tokens", "prompt tokens of one request"),
                       ("max-output-tokens", "max_tokens of one request")):
        q.add_argument(f"--tenant-{name}", type=int, default=0, metavar="N", help=f"each tenant's {what}")


def _add_parallel_args(s) -> None:
    g = s.add_argument_group("parallelism (jaxserve/server/multihost.py)")
    g.add_argument("--tp", type=int, default=1,
                   help="tensor-parallel degree: devices the model and KV cache are split over; in a "
                        "multi-process job, every device of the job")
    g.add_argument("--dp", type=int, default=1,
                   help="data-parallel replicas: a server runs one, so only 1 (run one server per "
                        "replica behind a load balancer)")
    g.add_argument("--coordinator", default=None, metavar="HOST:PORT",
                   help="process 0's jax.distributed coordinator (or JAXSERVE_COORDINATOR); with "
                        "--num-processes and --process-id: one process per host, process 0 serves")
    g.add_argument("--num-processes", type=int, default=None, help="or JAXSERVE_NUM_PROCESSES")
    g.add_argument("--process-id", type=int, default=None, help="or JAXSERVE_PROCESS_ID")


def setup_parallel(args):
    """Join the job's processes (if asked to) and make the mesh `--tp` names; None for one device.
    Every refusal is a ConfigError naming the flag."""
    from jaxserve.config import ConfigError
    if args.dp != 1:
        raise ConfigError(f"dp: a server runs one engine replica, got --dp {args.dp}; for data "
                          f"parallelism run one `jaxserve serve` per replica behind a load balancer "
                          f"(offline: scripts/generate_batch.py shards its input over processes)")
    if args.tp < 1:
        raise ConfigError(f"tp: must be >= 1, got {args.tp}")
    distributed = (args.coordinator, args.num_processes, args.process_id) != (None, None, None)
    if args.fake_fail_from_step is not None and not args.fake_model:
        raise ConfigError("fake_fail_from_step: needs --fake-model")
    if args.fake_model:
        if args.tp != 1 or distributed:
            raise ConfigError("fake_model: the fake model runs in one process on no device; "
                              "drop --tp / --coordinator / --num-processes / --process-id")
        return None
    import jax

    from sharding.mesh import initialize_distributed, make_mesh
    try:
        initialize_distributed(args.coordinator, args.num_processes, args.process_id)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if jax.process_count() > 1 and args.tp != jax.device_count():
        raise ConfigError(f"tp: a multi-process server's mesh spans every device of the job "
                          f"({jax.device_count()} over {jax.process_count()} processes), got --tp {args.tp}")
    if args.tp == 1:
        return None
    try:
        return make_mesh(tp=args.tp)
    except ValueError as e:
        raise ConfigError(f"tp: {e}") from None


def build_engine(args, mesh=None):
    """The engine and its description from `serve`'s flags (scripts/bench_serving.py reuses it)."""
    from jaxserve.config import ConfigError, EngineConfig
    from jaxserve.server.generation_service import ModelDescription

    engine_kw = dict(max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                     max_num_batched_tokens=args.max_num_batched_tokens,
                     kv_cache_bytes=args.kv_cache_mb * 2**20, token_buckets=args.token_buckets,
                     compilation_cache_dir=args.compilation_cache_dir or None,
                     enable_prefix_caching=args.enable_prefix_caching,
                     scheduling_policy=args.scheduling_policy,
                     priority_aging_rate=args.priority_aging_rate, fair_share=args.fair_share,
                     tenant_weights=args.tenant_weights)
    if args.fake_model:
        if args.num_speculative_tokens:
            raise ConfigError(f"num_speculative_tokens: the fake model does not verify draft tokens, "
                              f"got --num-speculative-tokens {args.num_speculative_tokens}")
        from jaxserve.server.fake_engine import make_fake_engine
        engine_kw["max_model_len"] = args.max_model_len or 4096
        engine_kw["num_pages"] = engine_kw.pop("kv_cache_bytes") // (16 * 1024)
        engine = make_fake_engine(step_delay_s=args.fake_step_delay, page_size=16, **engine_kw)
        if args.fake_fail_from_step is not None:
            from jaxserve.engine.faults import FaultInjectingRunner
            first = args.fake_fail_from_step
            engine.runner = FaultInjectingRunner(engine.runner, lambda step, plan, rows: step >= first,
                                                 lambda: RuntimeError("injected: the device is gone"))
        return engine, ModelDescription("fake", "jaxserve.server.fake_engine", "none", "none", "none")
    import jax

    from jaxserve import loading
    from jaxserve.engine.engine import Engine
    from jaxserve.model_args import load_options
    lm = loading.load(args.model, args.dtype, mesh, **load_options(args))
    tp = 1 if mesh is None else mesh.shape["tp"]
    engine = Engine(lm.model, lm.tokenizer,
                    EngineConfig(**engine_kw, tp=tp, num_speculative_tokens=args.num_speculative_tokens),
                    lm.eos_token_ids, mesh=mesh)
    dev = jax.devices()[0]
    quant = f"{lm.quantize}: {lm.weights}"
    if lm.quantize == "none" and lm.format == "gguf":
        quant += " (GGUF weights dequantized at load)"
    where = (f"1 device ({dev.platform}); no sharding" if mesh is None else
             f"tp={tp} over {tp} {dev.platform} devices in {jax.process_count()} process(es)")
    return engine, ModelDescription(lm.source.name, str(lm.source), args.dtype, quant, where)


def _tenant_limits(args):
    from jaxserve.config import ConfigError
    from jaxserve.scheduler.quotas import TenantLimits
    try:
        return TenantLimits(args.tenant_max_concurrent, args.tenant_max_queued,
                            args.tenant_tokens_per_minute, args.tenant_max_prompt_tokens,
                            args.tenant_max_output_tokens)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def cmd_serve(args) -> int:
    from jaxserve.server.config import ServerConfig
    from jaxserve.server.multihost import serve_job

    config = ServerConfig(
        host=args.host, port=args.port, max_queued_requests=args.max_queued_requests,
        max_queued_tokens=args.max_queued_tokens, grace_period_s=args.grace_period,
        stall_timeout_s=args.stall_timeout, progress=not args.no_progress,
        max_consecutive_step_faults=args.max_consecutive_step_faults,
        metrics_port=args.metrics_port, metrics_host=args.metrics_host, tls_cert=args.tls_cert, tls_key=args.tls_key,
        tls_client_ca=args.tls_client_ca, auth_token=_read_token(args.auth_token_file),
        http_port=args.http_port, grpc_enabled=not args.no_grpc,
        tenant_limits=_tenant_limits(args), slo_ttft_ms=args.slo_ttft_ms,
        slo_tpot_ms=args.slo_tpot_ms)
    mesh = setup_parallel(args)
    engine, description = build_engine(args, mesh)
    if args.served_model_name:
        import dataclasses
        description = dataclasses.replace(description, model=args.served_model_name)
    return serve_job(engine, config, description, announce=lambda line: print(line, flush=True))


def cmd_client(args) -> int:
    import grpc

    from jaxserve.server.client import connect
    from jaxserve.server.proto import generation_pb2 as pb

    req = pb.GenerateRequest(max_tokens=args.max_tokens, stop=args.stop)
    if args.chat:
        req.messages.messages.add(role="user", content=args.prompt)
    else:
        req.prompt = args.prompt
    for name in ("temperature", "top_p", "top_k", "seed"):
        if getattr(args, name) is not None:
            setattr(req, name, getattr(args, name))
    last = None
    with connect(args.server, token=_read_token(args.auth_token_file), tls=args.tls, tls_ca=args.tls_ca,
                 tls_cert=args.tls_cert, tls_key=args.tls_key) as client:
        try:
            for piece in client.stream(req, timeout=args.timeout):
                sys.stdout.write(piece.text)
                sys.stdout.flush()
                last = piece
        except grpc.RpcError as e:
            sys.stdout.write("\n")
            print(f"jaxserve: error: {e.code().name}: {e.details()}", file=sys.stderr)
            return 1
    sys.stdout.write("\n")
    if args.stats and last is not None:
        u, t = last.usage, last.timings
        print(f"[{u.prompt_tokens} prompt tokens, {u.completion_tokens} generated, "
              f"finish={pb.FinishReason.Name(last.finish_reason)}, TTFT {t.ttft_s * 1e3:.0f} ms, "
              f"TPOT {t.tpot_s * 1e3:.1f} ms, total {t.e2e_s:.2f} s]", file=sys.stderr)
    return 0
