"""The server's settings: where it listens, how much it queues, how it drains, who may call it."""

from __future__ import annotations

import dataclasses
import ipaddress

from jaxserve.config import ConfigError
from jaxserve.scheduler.quotas import TenantLimits


def _require(cond: bool, field: str, msg: str) -> None:
    if not cond:
        raise ConfigError(f"{field}: {msg}")


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"  # loopback by default; expose deliberately with --host 0.0.0.0
    port: int = 50051  # 0 = any free port (tests)
    # Admission: samples (a request with n samples counts n) and prompt tokens waiting to run,
    # i.e. accepted but not yet scheduled by the engine. Beyond these: RESOURCE_EXHAUSTED.
    max_queued_requests: int = 256
    max_queued_tokens: int = 262_144
    # Largest request message; the engine's own prompt limit (1M characters) sits below it, so a
    # too-long prompt is an INVALID_ARGUMENT naming the field, not a transport error.
    max_message_bytes: int = 32 * 2**20
    grace_period_s: float = 30.0  # SIGTERM: in-flight requests get this long to finish
    stall_timeout_s: float = 120.0  # a step running longer than this flips health to NOT_SERVING
    # A step fault fails the requests it blames and the engine goes on; this many in a row mean
    # the device is gone: liveness NOT_SERVING and `serve` exits non-zero (engine/faults.py).
    max_consecutive_step_faults: int = 3
    warmup: bool = True  # compile every bucket on the engine thread before serving
    progress: bool = True  # warm-up progress bar on stderr
    tokenizer_threads: int = 2
    metrics_port: int | None = None  # Prometheus /metrics over HTTP; None = off, 0 = any port
    metrics_host: str = "127.0.0.1"
    tls_cert: str | None = None  # PEM paths
    tls_key: str | None = None
    tls_client_ca: str | None = None  # set: clients must present a certificate it signed (mTLS)
    auth_token: str | None = None  # set: every call but health needs "authorization: Bearer <token>"
    grpc_enabled: bool = True  # False: HTTP only (needs http_port)
    # The OpenAI-compatible HTTP API (jaxserve/server/openai/) on `host`; None = off, 0 = any port.
    http_port: int | None = None
    # Limits every tenant (tenancy.tenant_of) gets; all 0 = none (scheduler/quotas.py).
    tenant_limits: TenantLimits = TenantLimits()
    # SLO-aware admission (scheduler/slo.py): refuse a request whose predicted TTFT exceeds this.
    slo_ttft_ms: float | None = None
    # ... and hold a TPOT target by capping a step's tokens (prefill chunks) and the running batch.
    slo_tpot_ms: float | None = None

    def __post_init__(self):
        for name in ("max_queued_requests", "max_queued_tokens", "max_message_bytes",
                     "tokenizer_threads", "max_consecutive_step_faults"):
            v = getattr(self, name)
            _require(isinstance(v, int) and not isinstance(v, bool) and v > 0, name,
                     f"must be a positive integer, got {v!r}")
        _require(isinstance(self.port, int) and 0 <= self.port <= 65535, "port",
                 f"must be in [0, 65535], got {self.port!r}")
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
        _require(self.grpc_enabled or self.http_port is not None, "grpc_enabled",
                 "with gRPC off the HTTP API must be on (http_port); a server needs a front door")

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
