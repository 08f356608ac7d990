"""The server's settings: where it listens, how much it queues, how it drains, who may call it.

Fields declared with `option()` are `jaxserve serve` flags (jaxserve/flags.py generates them);
the rest are set from code (auth_token is read from a file, never a flag value)."""

from __future__ import annotations

import dataclasses
import ipaddress

from jaxserve.config import ConfigError
from jaxserve.config_base import option
from jaxserve.engine import TenantLimits


def _require(cond: bool, field: str, msg: str) -> None:
    if not cond:
        raise ConfigError(f"{field}: {msg}")


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    host: str = option("127.0.0.1", "address to bind (default: loopback only; expose deliberately "
                       "with --host 0.0.0.0)")
    port: int = option(50051, "gRPC port; 0 = any free port (printed)")
    # Admission: samples (a request with n samples counts n) and prompt tokens waiting to run,
    # i.e. accepted but not yet scheduled by the engine. Beyond these: RESOURCE_EXHAUSTED.
    max_queued_requests: int = option(256, "samples waiting to run before RESOURCE_EXHAUSTED")
    max_queued_tokens: int = option(262_144, "prompt tokens waiting to run before RESOURCE_EXHAUSTED")
    # Largest request message; the engine's own prompt limit (1M characters) sits below it, so a
    # too-long prompt is an INVALID_ARGUMENT naming the field, not a transport error.
    max_message_bytes: int = option(32 * 2**20, "largest request message in bytes", cli=False)
    grace_period_s: float = option(30.0, "SIGTERM: time in-flight requests get to finish",
                                   flag="--grace-period", metavar="SECONDS")
    stall_timeout_s: float = option(120.0, "a step running longer turns health NOT_SERVING",
                                    flag="--stall-timeout", metavar="SECONDS")
    # A step fault fails the requests it blames and the engine goes on; this many in a row mean
    # the device is gone: liveness NOT_SERVING and `serve` exits non-zero (engine/faults.py).
    max_consecutive_step_faults: int = option(
        3, "a failed step fails the requests it blames and serving goes on; N in a row mean the "
           "device is gone: liveness NOT_SERVING and exit status 1", metavar="N")
    warmup: bool = option(True, "compile every bucket on the engine thread before serving", cli=False)
    progress: bool = option(True, "no warm-up progress bar", flag="--no-progress", negate=True)
    tokenizer_threads: int = option(2, "threads tokenizing prompts off the event loop", cli=False)
    # A one-line stats log while serving (throughput, running / waiting, KV cache use); 0 = off.
    stats_log_interval_s: float = option(10.0, "seconds between the one-line serving stats logs "
                                         "(info level); 0 = off", metavar="SECONDS")
    metrics_port: int | None = option(None, "serve Prometheus /metrics over HTTP on this port")
    metrics_host: str = option("127.0.0.1", "address for /metrics")
    tls_cert: str | None = option(None, "server certificate chain (PEM); enables TLS")  # PEM paths
    tls_key: str | None = option(None, "server private key (PEM)")
    tls_client_ca: str | None = option(None, "require client certificates signed by this CA (mTLS)")
    auth_token: str | None = option(None, "every call but health needs 'authorization: Bearer <token>' "
                                    "(read from --auth-token-file or the environment, never a flag value)",
                                    cli=False)
    grpc_enabled: bool = option(True, "serve HTTP only (needs --http-port)", flag="--no-grpc", negate=True)
    # The OpenAI-compatible HTTP API (jaxserve/server/openai/) on `host`; None = off, 0 = any port.
    http_port: int | None = option(
        None, "also serve the OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, "
              "/v1/models, /health, /ready, /live, /metrics) on this port, with the same queue, token and TLS; "
              "0 = any free port (printed)")
    # Limits every tenant (tenancy.tenant_of) gets; all 0 = none (scheduler/quotas.py).
    tenant_limits: TenantLimits = option(TenantLimits(), "limits each tenant gets (the --tenant-* flags)",
                                         cli=False)
    # SLO-aware admission (scheduler/slo.py): refuse a request whose predicted TTFT exceeds this.
    slo_ttft_ms: float | None = option(
        None, "SLO-aware admission: refuse (RESOURCE_EXHAUSTED, with a retry hint) a request whose "
              "predicted time to first token exceeds this (default: off)", metavar="MS")
    # ... and hold a TPOT target by capping a step's tokens (prefill chunks) and the running batch.
    slo_tpot_ms: float | None = option(
        None, "hold a time-per-output-token target: cap each step's tokens (prefill chunks) and the "
              "running batch to what the measured step cost fits in it; requests beyond it wait in "
              "the queue, none is refused for it (default: off)", metavar="MS")

    # Prefill/decode disaggregation (jaxserve/disagg/): what this server is in a deployment.
    role: str = option("colocated", "colocated: prefill and decode in this engine (the default); "
                       "prefill / decode: one half of a disaggregated deployment, behind a router; router: "
                       "the clients' front door over --prefill-servers and --decode-servers, no model",
                       choices=("colocated", "prefill", "decode", "router"))
    prefill_servers: str = option("", "router: comma-separated HOST:PORT of the --role prefill servers",
                                  metavar="ADDRS")
    decode_servers: str = option("", "router: comma-separated HOST:PORT of the --role decode servers",
                                 metavar="ADDRS")
    backend_tls_ca: str | None = option(None, "router: TLS to the prefill / decode servers, their certificates "
                                        "checked against this CA (PEM)")
    backend_tls_cert: str | None = option(None, "router: its client certificate chain (PEM) for servers that "
                                          "require mutual TLS (--tls-client-ca there)")
    backend_tls_key: str | None = option(None, "router: the private key (PEM) of --backend-tls-cert")
    kv_transfer_timeout_s: float = option(
        30.0, "decode role: a handover whose KV pages have not arrived (or found no room) by then "
              "fails UNAVAILABLE; prefill role: offers are held twice as long", flag="--kv-transfer-timeout",
        metavar="SECONDS")

    def __post_init__(self):
        for name in ("max_queued_requests", "max_queued_tokens", "max_message_bytes",
                     "tokenizer_threads", "max_consecutive_step_faults"):
            v = getattr(self, name)
            _require(isinstance(v, int) and not isinstance(v, bool) and v > 0, name,
                     f"must be a positive integer, got {v!r}")
        _require(isinstance(self.port, int) and 0 <= self.port <= 65535, "port",
                 f"must be in [0, 65535], got {self.port!r}")
        v = self.stats_log_interval_s
        _require(isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v < float("inf"),
                 "stats_log_interval_s", f"must be a number of seconds >= 0 (0 = off), got {v!r}")
        for name in ("grace_period_s", "stall_timeout_s"):
            v = getattr(self, name)
            _require(isinstance(v, (int, float)) and v > 0, name, f"must be > 0, got {v!r}")
        _require((self.tls_cert is None) == (self.tls_key is None), "tls_cert",
                 "tls_cert and tls_key must be given together")
        _require(self.tls_client_ca is None or self.tls_cert is not None, "tls_client_ca",
                 "mutual TLS needs the server's own tls_cert and tls_key")
        for name in ("slo_ttft_ms", "slo_tpot_ms"):
            v = getattr(self, name)
            _require(v is None or (isinstance(v, (int, float)) and not isinstance(v, bool)
                                   and 0 < v < float("inf")), name,
                     f"must be a positive number of milliseconds, got {v!r}")
        _require(self.auth_token is None or len(self.auth_token) >= 8, "auth_token",
                 "must be at least 8 characters")
        _require(self.http_port is None or (isinstance(self.http_port, int) and 0 <= self.http_port <= 65535),
                 "http_port", f"must be in [0, 65535], got {self.http_port!r}")
        _require(self.role in ("colocated", "prefill", "decode", "router"), "role",
                 f"must be colocated, prefill, decode or router, got {self.role!r}")
        v = self.kv_transfer_timeout_s
        _require(isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v < float("inf"),
                 "kv_transfer_timeout_s", f"must be a positive number of seconds, got {v!r}")
        _require((self.backend_tls_cert is None) == (self.backend_tls_key is None), "backend_tls_cert",
                 "backend_tls_cert and backend_tls_key must be given together")
        if self.role == "router":
            for name in ("prefill_servers", "decode_servers"):
                _require(bool(self.addresses(name)), name, "a router needs at least one (HOST:PORT,...)")
            _require(self.grpc_enabled, "grpc_enabled",
                     "a router always serves gRPC (and its health service); --http-port adds the OpenAI door")
        else:
            for name in ("prefill_servers", "decode_servers", "backend_tls_ca", "backend_tls_cert"):
                _require(not getattr(self, name), name, f"only a --role router takes it (role is {self.role})")
        _require(self.role not in ("prefill", "decode") or self.grpc_enabled, "grpc_enabled",
                 f"a {self.role} server is called by the router over gRPC")
        _require(self.grpc_enabled or self.http_port is not None, "grpc_enabled",
                 "with gRPC off the HTTP API must be on (http_port); a server needs a front door")

    def addresses(self, name: str) -> list[str]:
        """prefill_servers / decode_servers as a list."""
        return [a.strip() for a in getattr(self, name).split(",") if a.strip()]

    @property
    def address(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    @property
    def is_loopback(self) -> bool:
        if self.host == "localhost":
            return True
        try:
            return ipaddress.ip_address(self.host).is_loopback
        except ValueError:
            return False
