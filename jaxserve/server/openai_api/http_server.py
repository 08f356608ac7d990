"""uvicorn on the server's own event loop, beside grpc.aio.

The socket is bound here, synchronously, so a port in use is a ConfigError at start-up (as for
gRPC) and port 0 reports the port it got. TLS takes the same flags as gRPC: --tls-cert/--tls-key,
and --tls-client-ca for mutual TLS (client certificates required). Signals stay with
app.serve(): uvicorn's own handlers would replace the drain-on-SIGTERM ones.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl

import uvicorn

from jaxserve.config import ConfigError


class _Uvicorn(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self):
        yield  # the jaxserve server owns SIGTERM / SIGINT (drain)


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto=IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY on accepted connections only when the
    # protocol says TCP, and without it every response (headers and body written apart) waits
    # ~40 ms for the client's delayed ACK.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise ConfigError(f"http_port: cannot listen on {host}:{port} (in use, or not an address of "
                          f"this machine): {e}") from None
    sock.setblocking(False)
    return sock


class HttpFrontDoor:
    """Start with `await start()`, stop with `await stop()`; `port` is the bound port."""

    def __init__(self, app, host: str, port: int, tls_cert: str | None = None,
                 tls_key: str | None = None, tls_client_ca: str | None = None):
        self._sock = _bind(host, port)
        self.port = self._sock.getsockname()[1]
        kw = {}
        if tls_cert:
            kw = dict(ssl_certfile=tls_cert, ssl_keyfile=tls_key)
            if tls_client_ca:
                kw.update(ssl_ca_certs=tls_client_ca, ssl_cert_reqs=ssl.CERT_REQUIRED)
        # log_config=None: uvicorn must not run logging.config.dictConfig, which closes every
        # handler the host process installed (the application owns logging, not its HTTP door).
        config = uvicorn.Config(app, lifespan="off", log_config=None, log_level="warning", access_log=False,
                                timeout_graceful_shutdown=1, **kw)
        self._server = _Uvicorn(config)
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._server.serve(sockets=[self._sock]))
        while not self._server.started:
            if self._task.done():  # it failed to start: surface the error
                self._task.result()
                raise RuntimeError("the HTTP server stopped during start-up")
            await asyncio.sleep(0.005)

    async def stop(self) -> None:
        if self._task is None:
            return
        self._server.should_exit = True
        try:
            await asyncio.wait_for(asyncio.shield(self._task), 5.0)
        except asyncio.TimeoutError:
            self._server.force_exit = True
            await self._task
        finally:
            self._sock.close()
