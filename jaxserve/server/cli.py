"""`jaxserve serve` and `jaxserve client`, added to the main parser by jaxserve/cli.py.

Nothing heavy is imported at module level: building the parser must stay instant.
"""

from __future__ import annotations

import os
import sys

TOKEN_ENV = "JAXSERVE_AUTH_TOKEN"


def _read_token(path: str | None) -> str | None:
    """From a file (never a flag value: argv is visible to every user in `ps`), else the env."""
    if path:
        with open(path, encoding="utf-8") as f:
            return f.read().strip()
    return os.environ.get(TOKEN_ENV) or None


def add_serve_flags(s, exclude=(), server: bool = True) -> None:
    """Every flag of `jaxserve serve`: the model and engine flags and the server's, generated from
    the config dataclasses (jaxserve/flags.py), plus the few that are no config field.
    scripts/bench_serving.py and capacity.py take the engine half (server=False) for their
    in-process server, leaving out (exclude) fields whose flag they spell for themselves."""
    from jaxserve import flags
    from jaxserve.server.config import ServerConfig
    flags.add_engine_flags(s, exclude)
    flags.add_log_flags(s)
    if server:
        flags.add_flags(s, ServerConfig, "server (ServerConfig)", exclude)
    s.add_argument("--fake-model", action="store_true",
                   help="serve a hash-based fake model with a byte tokenizer instead (no weights, no "
                        "compilation): for client development and load tests of the server itself")
    s.add_argument("--fake-step-delay", type=float, default=0.0, metavar="SECONDS",
                   help="with --fake-model: sleep this long per engine step")
    s.add_argument("--fake-fail-from-step", type=int, default=None, metavar="N",
                   help="with --fake-model: every step from the N-th on raises, as on a device that "
                        "is gone (tests of the unrecoverable-fault exit)")
    s.add_argument("--served-model-name", default=None,
                   help="the model name clients send in OpenAI requests (default: the model's file "
                        "or folder name; 'fake' with --fake-model)")
    if not server:
        s.set_defaults(dp=1, coordinator=None, num_processes=None, process_id=None)
        return
    s.add_argument("--auth-token-file", help=f"require 'authorization: Bearer <token>' (token read "
                                             f"from this file; or set {TOKEN_ENV})")
    q = s.add_argument_group("per-tenant limits (jaxserve/scheduler/quotas.py; 0 = unlimited)")
    for name, what in (("max-concurrent", "requests in flight"),
                       ("max-queued", "requests waiting for their first token"),
                       ("tokens-per-minute", "prompt + output tokens a minute (token bucket)"),
                       ("max-prompt-tokens", "prompt tokens of one request"),
                       ("max-output-tokens", "max_tokens of one request")):
        q.add_argument(f"--tenant-{name}", type=int, default=0, metavar="N", help=f"each tenant's {what}")
    _add_parallel_args(s)


def add_server_commands(sub) -> None:
    s = sub.add_parser("serve", help="serve the gRPC API (jaxserve.v1.Generation, JetStream's "
                                     "Orchestrator, health, reflection)")
    add_serve_flags(s)
    s.set_defaults(run=cmd_serve)

    c = sub.add_parser("client", help="stream an answer from a running `jaxserve serve`")
    c.add_argument("prompt")
    c.add_argument("--server", default="localhost:50051")
    c.add_argument("--chat", action="store_true", help="send the prompt as one user chat turn")
    c.add_argument("--max-tokens", type=int, default=256)
    c.add_argument("--temperature", type=float, default=None,
                   help="0 = greedy; unset, the server's gRPC default: greedy")
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


def _add_parallel_args(s) -> None:
    g = s.add_argument_group("parallelism (jaxserve/server/multihost.py)")
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
    from jaxserve import flags
    from jaxserve.config import ConfigError
    _, engine_config = flags.engine_configs(args)  # the configs' own checks first, before jax
    tp = engine_config.tp
    if args.dp != 1:
        raise ConfigError(f"dp: a server runs one engine replica, got --dp {args.dp}; for data "
                          f"parallelism run one `jaxserve serve` per replica behind a load balancer "
                          f"(offline: scripts/generate_batch.py shards its input over processes)")
    distributed = (args.coordinator, args.num_processes, args.process_id) != (None, None, None)
    if args.fake_fail_from_step is not None and not args.fake_model:
        raise ConfigError("fake_fail_from_step: needs --fake-model")
    if args.fake_model:
        if tp != 1 or distributed:
            raise ConfigError("fake_model: the fake model runs in one process on no device; "
                              "drop --tp / --coordinator / --num-processes / --process-id")
        return None
    import jax

    from jaxserve.engine.build import engine_mesh
    from sharding.mesh import initialize_distributed
    try:
        initialize_distributed(args.coordinator, args.num_processes, args.process_id)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if jax.process_count() > 1 and tp != jax.device_count():
        raise ConfigError(f"tp: a multi-process server's mesh spans every device of the job "
                          f"({jax.device_count()} over {jax.process_count()} processes), got --tp {tp}")
    return engine_mesh(tp)


def build_engine(args, mesh=None):
    """The engine and its description from `serve`'s flags (scripts/bench_serving.py and
    capacity.py reuse it)."""
    import dataclasses

    from jaxserve import flags
    from jaxserve.config import ConfigError
    from jaxserve.server.generation_service import ModelDescription

    load, config = flags.engine_configs(args)
    if args.fake_model:
        if config.num_speculative_tokens:
            raise ConfigError(f"num_speculative_tokens: the fake model does not verify draft tokens, "
                              f"got --num-speculative-tokens {config.num_speculative_tokens}")
        from jaxserve.kv_sizing import CPU_KV_CACHE_BYTES
        from jaxserve.server.fake_engine import make_fake_engine
        # The fake model's pages are tiny: a page per 16 KiB of the pool, like a small real model.
        flat = {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.name != "scheduler"}
        flat.update({f.name: getattr(config.scheduler, f.name) for f in dataclasses.fields(config.scheduler)})
        flat["max_model_len"] = config.max_model_len or 4096
        flat["num_pages"] = config.num_pages or (config.kv_cache_bytes or CPU_KV_CACHE_BYTES) // (16 * 1024)
        flat["kv_cache_bytes"] = None
        engine = make_fake_engine(step_delay_s=args.fake_step_delay, **flat)
        if args.fake_fail_from_step is not None:
            from jaxserve.engine.faults import FaultInjectingRunner
            first = args.fake_fail_from_step
            engine.runner = FaultInjectingRunner(engine.runner, lambda step, plan, rows: step >= first,
                                                 lambda: RuntimeError("injected: the device is gone"))
        return engine, ModelDescription("fake", "jaxserve.server.fake_engine", "none", "none", "none")
    import jax

    from jaxserve.engine.build import build_engine as build
    lm, engine = build(load, config, mesh, progress=flags.progress_enabled(args))
    tp = config.tp
    dev = jax.devices()[0]
    quant = f"{lm.quantize}: {lm.weights}"
    if lm.quantize == "none" and lm.format == "gguf":
        quant += " (GGUF weights dequantized at load)"
    where = (f"1 device ({dev.platform}); no sharding" if engine.mesh is None else
             f"tp={tp} over {tp} {dev.platform} devices in {jax.process_count()} process(es)")
    return engine, ModelDescription(lm.source.name, str(lm.source), str(lm.model.dtype), quant, where)


def _tenant_limits(args):
    from jaxserve.config import ConfigError
    from jaxserve.scheduler.quotas import TenantLimits
    try:
        return TenantLimits(args.tenant_max_concurrent, args.tenant_max_queued,
                            args.tenant_tokens_per_minute, args.tenant_max_prompt_tokens,
                            args.tenant_max_output_tokens)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def server_config(args):
    """ServerConfig from `serve`'s flags (checked, like the engine's, before anything loads)."""
    from jaxserve import flags
    from jaxserve.server.config import ServerConfig
    return flags.from_args(ServerConfig, args, auth_token=_read_token(args.auth_token_file),
                           tenant_limits=_tenant_limits(args))


def cmd_serve(args) -> int:
    from jaxserve import flags

    flags.setup_logging(args.log_level)
    config = server_config(args)
    from jaxserve.server.app import announce_line  # one write per line (see there)
    if config.role == "router":  # no model: the front door over the prefill and decode servers
        from jaxserve.disagg.router import serve_router
        tokenizer = None
        if config.http_port is not None:  # the OpenAI door renders token texts: the model's tokenizer
            from jaxserve.loading import load_tokenizer_of
            tokenizer = load_tokenizer_of(args.model)
        return serve_router(config, announce=announce_line, tokenizer=tokenizer)
    flags.engine_configs(args)  # every engine check too, before jax starts or a byte is read
    from jaxserve.server.multihost import serve_job
    server_kw = {}
    if config.role in ("prefill", "decode"):
        from jaxserve.config import ConfigError
        if (args.coordinator, args.num_processes, args.process_id) != (None, None, None):
            raise ConfigError(f"role: a {config.role} server runs in one process (tensor parallelism "
                              f"with --tp on its devices); drop --coordinator / --num-processes")
        if args.fake_model:
            raise ConfigError(f"role: the fake model's KV is not device arrays the transfer server "
                              f"moves; a {config.role} server needs a real model")
    mesh = setup_parallel(args)
    engine, description = build_engine(args, mesh)
    if config.role in ("prefill", "decode"):
        from jaxserve.disagg.port import TransferPort
        from jaxserve.disagg.service import service_factory
        server_kw = dict(kv_port=TransferPort(config.kv_transfer_timeout_s, config.host),
                         extra_services=(service_factory(config.role),))
    if args.served_model_name:
        import dataclasses
        description = dataclasses.replace(description, model=args.served_model_name)
    return serve_job(engine, config, description, announce=announce_line, **server_kw)


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
