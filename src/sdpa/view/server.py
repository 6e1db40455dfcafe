"""The local server of `sdpa view`: a few fixed GET endpoints over one Session.

    GET /                     the page (index.html); /app.js, /app.css: its assets
    GET /info                 tokens or picture, heads per layer, the head summaries done
    GET /grid                 one summary per head (null for layers not done yet)
    GET /row?layer=L&head=H&query=I     {"weights": [n floats]}: w[0, H, I] of layer L
                                        (head=mean: the head average)
    GET /head?layer=L&head=H  {"entropy": [n], "received": [n]} per token

The standard library serves it: connections.py reads requests with a selector and
answers them on a bounded pool of threads, and http.server's request parsing runs on each
head; a few fixed GET endpoints on 127.0.0.1 with JSON answers need no framework, and the
package keeps torch as its only runtime dependency. Every query parameter is checked
(known name, given once, an integer in range) and a bad one answers 400 with a JSON
error; unknown paths 404, other methods 405, long request lines 414, heads past
connections.MAX_HEAD 431, a Host header other than this server's (DNS rebinding) 403.
No request names a file: the assets are a fixed table.
"""

from __future__ import annotations

import io
import json
import logging
import socket
import threading
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler
from importlib import resources
from urllib.parse import parse_qsl, urlsplit

from sdpa.view.connections import MAX_HEAD, SelectorServer, head_end, listen
from sdpa.view.session import MEAN, Session, ViewError

log = logging.getLogger(__name__)

MAX_TARGET = 1024  # bytes of a request target (path and query); our URLs use < 60
ASSETS = {  # path -> (file in sdpa/view/static, content type)
    "/": ("index.html", "text/html; charset=utf-8"),
    "/app.js": ("app.js", "text/javascript; charset=utf-8"),
    "/app.css": ("app.css", "text/css; charset=utf-8"),
}
PARAMS = {"/info": (), "/grid": (), "/row": ("layer", "head", "query"), "/head": ("layer", "head")}
# The page may load only from this server: no CDN, no external request, no inline code.
CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
    "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)


def asset(name: str) -> bytes:
    """One file of the page, shipped in sdpa/view/static."""
    return resources.files("sdpa.view").joinpath("static", name).read_bytes()


class BadRequest(Exception):
    """A request we refuse: its status and a message for the JSON error."""

    def __init__(self, status: HTTPStatus, message: str):
        super().__init__(message)
        self.status = status


def _params(query: str, allowed: tuple[str, ...]) -> dict[str, str]:
    """The query string as {name: value}: known names only, each exactly once."""
    try:
        pairs = parse_qsl(query, keep_blank_values=True, strict_parsing=bool(query))
    except ValueError as e:
        raise BadRequest(HTTPStatus.BAD_REQUEST, f"malformed query string: {e}") from e
    out: dict[str, str] = {}
    for name, value in pairs:
        if name not in allowed:
            want = ", ".join(allowed) or "none"
            raise BadRequest(
                HTTPStatus.BAD_REQUEST, f"unknown parameter {name!r}; this endpoint takes: {want}"
            )
        if name in out:
            raise BadRequest(HTTPStatus.BAD_REQUEST, f"parameter {name!r} given twice")
        out[name] = value
    missing = [n for n in allowed if n not in out]
    if missing:
        raise BadRequest(HTTPStatus.BAD_REQUEST, f"missing parameter(s): {', '.join(missing)}")
    return out


def _integer(name: str, value: str) -> int:
    """A decimal integer of at most 9 digits (no sign, spaces or exponent)."""
    if not (value.isascii() and value.isdecimal() and len(value) <= 9):
        raise BadRequest(
            HTTPStatus.BAD_REQUEST, f"{name} must be a non-negative integer, got {value[:40]!r}"
        )
    return int(value)


def _head(value: str) -> int | str:
    return MEAN if value == MEAN else _integer("head", value)


def answer(session: Session, path: str, query: str) -> dict:
    """The JSON answer of a data endpoint, or BadRequest."""
    if path not in PARAMS:
        raise BadRequest(HTTPStatus.NOT_FOUND, f"no such endpoint {path[:80]!r}")
    p = _params(query, PARAMS[path])
    try:
        if path == "/info":
            return session.info()
        if path == "/grid":
            return session.grid()
        layer, head = _integer("layer", p["layer"]), _head(p["head"])
        if path == "/head":
            return {"layer": layer, "head": head, **session.head_stats(layer, head)}
        q = _integer("query", p["query"])
        row = session.row(layer, head, q)
        return {"layer": layer, "head": head, "query": q, "weights": row.tolist()}
    except ViewError as e:
        raise BadRequest(HTTPStatus.BAD_REQUEST, str(e)) from e


class Handler(BaseHTTPRequestHandler):
    """GET of the fixed endpoints; everything else refused with a JSON error.

    Runs on one request head read by the server (no socket): the answer is collected in
    wfile, and close_connection says whether the connection ends after it.
    """

    server: ViewServer
    protocol_version = "HTTP/1.1"

    def __init__(self, head: bytes, client_address, server: ViewServer):
        self.client_address, self.server = client_address, server
        self.rfile, self.wfile = io.BytesIO(head), io.BytesIO()
        self.close_connection = True
        if head_end(head) < 0:  # the first MAX_HEAD bytes of a longer head
            self.requestline, self.request_version, self.command = "", "", ""
            self.send_error(HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE,
                            f"request head over {MAX_HEAD} bytes")  # fmt: skip
            return
        self.handle_one_request()

    def do_GET(self) -> None:
        try:
            self._get()
        except BadRequest as e:
            self._json({"error": str(e), "status": int(e.status)}, e.status)
        except Exception:  # a bug of ours: logged here, never sent as a traceback
            log.exception("sdpa view: %s failed", self.path[:MAX_TARGET])
            status = HTTPStatus.INTERNAL_SERVER_ERROR
            self._json({"error": "internal error (see the server's log)", "status": 500}, status)

    def _get(self) -> None:
        if len(self.path) > MAX_TARGET:
            raise BadRequest(
                HTTPStatus.REQUEST_URI_TOO_LONG, f"request target over {MAX_TARGET} bytes"
            )
        if self.headers.get("Content-Length", "0") != "0" or "Transfer-Encoding" in self.headers:
            raise BadRequest(HTTPStatus.BAD_REQUEST, "GET requests carry no body")
        host = self.headers.get("Host", "")
        if host not in self.server.hosts:
            raise BadRequest(HTTPStatus.FORBIDDEN, f"unexpected Host header {host[:80]!r}")
        parts = urlsplit(self.path)
        if parts.path in ASSETS:
            if parts.query:
                raise BadRequest(HTTPStatus.BAD_REQUEST, "the page's files take no parameters")
            name, kind = ASSETS[parts.path]
            self._send(asset(name), kind, HTTPStatus.OK)
            return
        self._json(answer(self.server.session, parts.path, parts.query), HTTPStatus.OK)

    def _refuse(self) -> None:
        self.close_connection = True
        body = {"error": f"method {self.command} not allowed: GET only", "status": 405}
        self._json(body, HTTPStatus.METHOD_NOT_ALLOWED, {"Allow": "GET"})

    do_POST = do_PUT = do_DELETE = do_PATCH = do_HEAD = do_OPTIONS = do_TRACE = _refuse
    do_CONNECT = _refuse

    def _json(self, body: dict, status: HTTPStatus, extra: dict | None = None) -> None:
        data = json.dumps(body, separators=(",", ":"), allow_nan=False).encode()
        self._send(data, "application/json", status, extra)

    def _send(self, data: bytes, kind: str, status: HTTPStatus, extra: dict | None = None):
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(data)))
        self.send_header("Cache-Control", "no-store")
        self.send_header("X-Content-Type-Options", "nosniff")
        self.send_header("Content-Security-Policy", CSP)
        for key, value in (extra or {}).items():
            self.send_header(key, value)
        if status >= 400:
            self.close_connection = True
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    def send_error(self, code, message=None, explain=None) -> None:
        """http.server's own refusals (a malformed request line, too many headers, an
        unsupported method) as JSON too."""
        self.close_connection = True
        self._json({"error": message or HTTPStatus(code).phrase, "status": code},
                   HTTPStatus(code))  # fmt: skip

    def version_string(self) -> str:
        return "sdpa-view"

    def log_message(self, format: str, *args) -> None:
        log.debug("%s " + format, self.address_string(), *args)


class ViewServer(SelectorServer):
    """Serves one Session on 127.0.0.1 only; port 0 takes a free port.

    listener: a socket from connections.listen() to serve on instead (bound before the
    model ran); the limits (workers, max_connections, timeouts) are SelectorServer's.
    """

    def __init__(
        self, session: Session, port: int = 0, *, listener: socket.socket | None = None, **limits
    ):
        self._stop = threading.Event()
        self._stats_thread: threading.Thread | None = None
        listener = listen(port) if listener is None else listener
        try:
            super().__init__(listener, **limits)
        except Exception:
            listener.close()
            raise
        self.session = session
        self.port = listener.getsockname()[1]
        self.hosts = {f"127.0.0.1:{self.port}", f"localhost:{self.port}"}

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/"

    def respond(self, head: bytes, address) -> tuple[bytes, bool]:
        handler = Handler(head, address, self)
        return handler.wfile.getvalue(), not handler.close_connection

    def serve_forever(self, poll_interval: float = 0.5) -> None:
        """Answer requests; the statistics are computed meanwhile, layer by layer."""
        if self._stats_thread is None:
            self._stats_thread = threading.Thread(
                target=self._statistics, name="sdpa-view-stats", daemon=True
            )
            self._stats_thread.start()
        super().serve_forever(poll_interval)

    def _statistics(self) -> None:
        try:
            self.session.compute_statistics(self._stop)
        except Exception:  # a request for the layer computes it again, and says why
            log.exception("sdpa view: computing the statistics failed")

    def server_close(self) -> None:
        """Close the sockets, and let the statistics thread finish the layer it is on
        (a thread inside torch at interpreter exit would abort the process)."""
        super().server_close()
        self._stop.set()
        if self._stats_thread is not None:
            self._stats_thread.join()

    def start(self) -> threading.Thread:
        """Serve in a background thread (tests, notebooks); stop with stop()."""
        thread = threading.Thread(target=self.serve_forever, name="sdpa-view", daemon=True)
        thread.start()
        return thread

    def stop(self) -> None:
        self.shutdown()
        self.server_close()
