"""A Prometheus registry served on ``/metrics`` over plain HTTP in the text exposition
format (prometheus_client), on a thread; the coordinator and the workers each serve one."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, start_http_server


class MetricsServer:
    """``registry`` on http://HOST:PORT/metrics until ``close()``; ``port`` 0 picks a free
    one (``.port`` says which). The endpoint has no authentication: bind it to loopback, or
    to an address only a private network reaches."""

    def __init__(self, registry: CollectorRegistry, host: str, port: int) -> None:
        try:
            self._server, self._thread = start_http_server(port, host, registry)
        except OSError as exc:
            raise OSError(f"cannot serve metrics on {host}:{port} ({exc.strerror or exc}); pick "
                          "a free monitoring port, or 0 for any") from None
        self.host = host
        self.port: int = self._server.server_port

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5.0)
