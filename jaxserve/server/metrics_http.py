"""The metrics port (`--metrics-port`): Prometheus text at /metrics and nothing else.

prometheus_client's own `start_http_server` answers every path with the metrics and 200, so a
readiness probe aimed at this port by mistake (`/ready`, `/v1/models`) passed on a server that
was still warming up. Here any other path is 404 and any method but GET / HEAD is 405.
"""

from __future__ import annotations

import socket
import threading
from http.server import ThreadingHTTPServer
from urllib.parse import urlparse

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import MetricsHandler


class _OnlyMetrics(MetricsHandler):
    def do_GET(self) -> None:
        if urlparse(self.path).path != "/metrics":
            body = b"not found: this port serves /metrics only\n"
            self.send_response(404)
            self.send_header("Content-Type", "text/plain; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return
        super().do_GET()

    def do_HEAD(self) -> None:
        ok = urlparse(self.path).path == "/metrics"
        self.send_response(200 if ok else 404)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def _not_allowed(self) -> None:
        self.send_response(405)
        self.send_header("Allow", "GET, HEAD")
        self.send_header("Content-Length", "0")
        self.end_headers()

    do_POST = do_PUT = do_DELETE = do_PATCH = _not_allowed


class _Server(ThreadingHTTPServer):
    daemon_threads = True


def start_metrics_http(registry: CollectorRegistry, host: str, port: int) -> ThreadingHTTPServer:
    """Serve on a daemon thread; `.server_port` is the bound port, `.shutdown()` stops it."""
    handler = type("MetricsOnly", (_OnlyMetrics,), {"registry": registry})
    cls = _Server
    if ":" in host:  # an IPv6 literal
        cls = type("_Server6", (_Server,), {"address_family": socket.AF_INET6})
    server = cls((host, port), handler)
    threading.Thread(target=server.serve_forever, name="jaxserve-metrics", daemon=True).start()
    return server
