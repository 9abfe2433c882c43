"""Running the server: `check_address` (a non-loopback address needs an API key), `bind` (the listening socket,
made before the model loads so a port in use is said at once), and `serve` (the app over an Engine, run by uvicorn
on that socket until ctrl+c or SIGTERM).

uvicorn handles SIGINT/SIGTERM itself: it stops accepting, gives replies in flight SHUTDOWN_S seconds, stops the
engine's worker (the reply in flight is cancelled), then raises the signal again for the caller (the CLI's exit
130/143). A process started with SIGINT ignored (a background job of a script, a test runner's worker) would
swallow that second SIGINT and exit 0: `serve` then raises KeyboardInterrupt itself, so the status is 130 however
the process was started. Imports app.py, uvicorn and localmoe.errors.
"""

from __future__ import annotations

import ipaddress
import signal
import socket

import uvicorn

from localmoe.errors import UsageError
from localmoe.server.app import MAX_BODY, create_app

SHUTDOWN_S = 3
API_KEY_ENV = "LOCALMOE_API_KEY"


class _Server(uvicorn.Server):
    """uvicorn's server, noting the signals that stopped it."""

    def __init__(self, config):
        super().__init__(config)
        self.stopped_by: list[int] = []

    def handle_exit(self, sig, frame) -> None:
        self.stopped_by.append(sig)
        super().handle_exit(sig, frame)


def is_loopback(host: str) -> bool:
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_address(host: str, api_key: str | None) -> None:
    """Anything but a loopback address serves the network: refused without an API key."""
    if not is_loopback(host) and not api_key:
        raise UsageError(
            f"--host {host} lets other machines use the model: set --api-key KEY (or {API_KEY_ENV}) too, "
            "or serve on 127.0.0.1"
        )


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on host:port (port 0: a free one)."""
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(
            host.strip("[]"), port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
    except socket.gaierror as e:
        raise UsageError(
            f"--host {host}: cannot resolve it ({e.strerror}): give an address such as 127.0.0.1"
        ) from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
        sock.listen(128)
    except OSError as e:
        sock.close()
        reason = "is in use" if e.errno in (98, 48) else f"cannot be used ({e.strerror})"
        raise UsageError(f"port {port} on {host} {reason}: pick another with --port") from None
    sock.set_inheritable(True)
    return sock


def url(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://{f'[{host}]' if ':' in host else host}:{port}/v1"


def serve(
    engine,
    sock: socket.socket,
    *,
    names: list[str],
    api_key: str | None = None,
    max_queue: int = 16,
    max_body: int = MAX_BODY,
    cors_origins: list[str] | None = None,
    log=None,
) -> None:
    """Serve `engine` on `sock` until stopped (blocks)."""
    app = create_app(
        engine,
        names=names,
        api_key=api_key,
        max_queue=max_queue,
        max_body=max_body,
        cors_origins=cors_origins,
        log=log,
    )
    config = uvicorn.Config(
        app,
        log_level="warning",
        access_log=False,
        lifespan="on",
        timeout_graceful_shutdown=SHUTDOWN_S,
        server_header=False,
    )
    server = _Server(config)
    try:
        server.run(sockets=[sock])
    finally:
        app.state.worker.close()
        app.state.worker.join(timeout=10)
        sock.close()
    if signal.SIGINT in server.stopped_by:  # re-raised above unless SIGINT was ignored when the process started
        raise KeyboardInterrupt
