"""A Prometheus registry served on ``/metrics`` over plain HTTP in the text exposition
format (prometheus_client), on a thread, with at most MAX_CONNECTIONS connections at once and
each one cut after CONNECTION_IDLE_S of silence; the coordinator and the workers each serve one."""

from __future__ import annotations

import socket
import threading
from http.server import ThreadingHTTPServer

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import MetricsHandler

MAX_CONNECTIONS = 8  # connections served at once (a thread each); more are closed at once
CONNECTION_IDLE_S = 5.0  # a connection that sends nothing this long is closed


class _BoundedServer(ThreadingHTTPServer):
    """A thread per connection, at most ``max_connections`` of them: a connection beyond
    that is closed as soon as it is accepted."""

    daemon_threads = True
    request_queue_size = 128

    def __init__(self, address: tuple[str, int], handler: type, max_connections: int) -> None:
        self._slots = threading.BoundedSemaphore(max_connections)
        self.address_family = socket.getaddrinfo(address[0], address[1], type=socket.SOCK_STREAM,
                                                 flags=socket.AI_PASSIVE)[0][0]
        super().__init__(address, handler)

    def process_request(self, request, client_address) -> None:  # noqa: ANN001 (socketserver's)
        if not self._slots.acquire(blocking=False):
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request, client_address) -> None:  # noqa: ANN001
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()


class MetricsServer:
    """``registry`` on http://HOST:PORT/metrics until ``close()``; ``port`` 0 picks a free
    one (``.port`` says which). The endpoint has no authentication: bind it to loopback, or
    to an address only a private network reaches."""

    def __init__(self, registry: CollectorRegistry, host: str, port: int,
                 max_connections: int = MAX_CONNECTIONS, idle_s: float = CONNECTION_IDLE_S) -> None:
        handler = type("BoundedMetricsHandler", (MetricsHandler.factory(registry),),
                       {"timeout": idle_s, "log_message": lambda *_: None})
        try:
            self._server = _BoundedServer((host, port), handler, max_connections)
        except OSError as exc:
            raise OSError(f"cannot serve metrics on {host}:{port} ({exc.strerror or exc}); pick "
                          "a free monitoring port, or 0 for any") from None
        self._thread = threading.Thread(target=self._server.serve_forever, name="metrics-http",
                                        daemon=True)
        self._thread.start()
        self.host = host
        self.port: int = self._server.server_port

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5.0)
