"""The connections of the viewer's server: one selector thread reads, a bounded pool answers.

    listener = listen(port)              # 127.0.0.1:port bound and listening, before any work
    server = SelectorServer(listener)    # subclass it: respond(head, address) -> (bytes, keep)
    server.serve_forever()               # until shutdown() from another thread (or Ctrl-C)
    server.server_close()                # the sockets and the threads, freed

One thread accepts connections and reads their request heads without blocking (a
selector): a connection that sends nothing holds a socket, never a thread. A complete
head goes to one of `workers` threads, which computes the answer and writes it; the
connection then goes back to the selector (keep-alive) or is closed.

Bounds: `workers` threads; `max_connections` open sockets (past it the longest idle one
is closed, or the listener waits); the listen backlog (`BACKLOG`, for a browser's bursts);
an idle connection closed after `idle_timeout` s; a head started must be complete within
`head_timeout` s and within `MAX_HEAD` bytes; an answer written within `write_timeout` s.
A client that goes away is one debug line, never a traceback.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import logging
import selectors
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

log = logging.getLogger(__name__)

BACKLOG = 1024  # connections the kernel holds before accept (capped by net.core.somaxconn)
MAX_HEAD = 65_536 + 4096  # bytes of a request head: http.server's line limit and some headers
WORKERS = 8  # threads that answer; rows are short torch calls that release the GIL
MAX_CONNECTIONS = 1024
IDLE_TIMEOUT = 60.0  # s: a keep-alive connection with no request (browsers reconnect)
HEAD_TIMEOUT = 10.0  # s from a head's first byte to its end
WRITE_TIMEOUT = 10.0  # s to write one answer to a client that does not read
OUT_OF_FILES = {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM}


def listen(port: int = 0, backlog: int = BACKLOG) -> socket.socket:
    """A socket bound to 127.0.0.1:port and listening (port 0: a free one); OSError when
    the port is taken or not ours to bind."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as http.server does
        sock.bind(("127.0.0.1", port))
        sock.listen(backlog)
    except OSError:
        sock.close()
        raise
    return sock


def head_end(buf: bytes | bytearray) -> int:
    """Where the first request head in buf ends (after its empty line), or -1."""
    ends = [i + n for i, n in ((buf.find(b"\n\r\n"), 3), (buf.find(b"\n\n"), 2)) if i >= 0]
    return min(ends) if ends else -1


class _Connection:
    """One client socket: its unread bytes, and since when it is idle (or its head began)."""

    __slots__ = ("address", "buf", "fd", "since", "sock")

    def __init__(self, sock: socket.socket, address, now: float):
        self.sock, self.fd, self.address = sock, sock.fileno(), address
        self.buf = bytearray()
        self.since = now

    def name(self) -> str:
        return f"{self.address[0]}:{self.address[1]}"


class SelectorServer:
    """Answers requests on a listening socket; subclasses define respond()."""

    def __init__(
        self,
        listener: socket.socket,
        *,
        workers: int = WORKERS,
        max_connections: int = MAX_CONNECTIONS,
        idle_timeout: float = IDLE_TIMEOUT,
        head_timeout: float = HEAD_TIMEOUT,
        write_timeout: float = WRITE_TIMEOUT,
    ):
        for name, value in (("workers", workers), ("max_connections", max_connections)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        for name, value in (("idle_timeout", idle_timeout), ("head_timeout", head_timeout),
                            ("write_timeout", write_timeout)):  # fmt: skip
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
                raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
        self.listener = listener
        self.listener.setblocking(False)
        self.workers, self.max_connections = workers, max_connections
        self.idle_timeout, self.head_timeout = float(idle_timeout), float(head_timeout)
        self.write_timeout = float(write_timeout)
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="sdpa-view-worker")
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._selector.register(self._wake_r, selectors.EVENT_READ)
        self._selector.register(self.listener, selectors.EVENT_READ)
        self._waiting = selectors.DefaultSelector()  # the listener alone: is someone waiting?
        self._waiting.register(self.listener, selectors.EVENT_READ)
        self._listening, self._resume_at = True, 0.0
        self._warned_at = -float("inf")
        self._conns: dict[int, _Connection] = {}  # every open one: the loop thread's alone
        self._returned: collections.deque = collections.deque()  # (conn, keep) from workers
        self._shutdown = False
        self._done = threading.Event()
        self._done.set()  # not serving
        self._closed = False

    def respond(self, head: bytes, address) -> tuple[bytes, bool]:
        """(the answer's bytes, keep the connection open) for one request head: a complete
        head (its empty line included), or the first MAX_HEAD bytes of a longer one (the
        connection closes after the answer). Runs in a worker thread."""
        raise NotImplementedError

    @property
    def connections(self) -> int:
        """Open client connections (idle, being read, or being answered)."""
        return len(self._conns)

    def serve_forever(self, poll_interval: float = 0.5) -> None:
        """Accept, read and dispatch until shutdown() (or an exception, e.g. Ctrl-C)."""
        self._done.clear()
        sweep_every = min(0.5, self.idle_timeout / 4, self.head_timeout / 4)
        next_sweep = time.monotonic() + sweep_every
        try:
            while not self._shutdown:
                for key, _ in self._selector.select(min(poll_interval, sweep_every)):
                    now = time.monotonic()
                    if key.fileobj is self.listener:
                        self._accept(now)
                    elif key.fileobj is self._wake_r:
                        self._take_back(now)
                    elif self._conns.get(key.data.fd) is key.data:  # not closed meanwhile
                        self._read(key.data, now)
                now = time.monotonic()
                if now >= next_sweep:
                    self._sweep(now)
                    next_sweep = now + sweep_every
                if not self._listening and now >= self._resume_at:  # _accept pauses again
                    self._selector.register(self.listener, selectors.EVENT_READ)
                    self._listening = True
        finally:
            self._done.set()

    def shutdown(self) -> None:
        """Stop serve_forever (called from another thread) and wait until it has."""
        self._shutdown = True
        self._wake()
        self._done.wait()

    def server_close(self) -> None:
        """Close the listener and every connection; wait for the answers being computed.
        Call it after serve_forever has returned."""
        if self._closed:
            return
        self._closed = True
        self._shutdown = True
        self.listener.close()
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._returned.clear()  # their connections are still in _conns
        for conn in list(self._conns.values()):
            conn.sock.close()
        self._conns.clear()
        self._selector.close()
        self._waiting.close()
        self._wake_r.close()
        self._wake_w.close()

    # the loop thread's work

    def _accept(self, now: float) -> None:
        for _ in range(64):  # a burst at a time; the selector calls again for the rest
            full = len(self._conns) >= self.max_connections
            if full and not any(not c.buf for c in self._idle()):
                self._pause(float("inf"))  # nothing to close: until one closes or idles
                return
            try:
                sock, address = self.listener.accept()
            except BlockingIOError:
                return
            except OSError as e:
                if e.errno not in OUT_OF_FILES:  # e.g. ECONNABORTED: that client is gone
                    continue
                if not self._waiting.select(0):  # EMFILE comes first, even with no one there
                    return
                if now - self._warned_at > 10:  # one line per 10 s, not one per client
                    self._warned_at = now
                    log.warning("sdpa view: cannot accept connections: %s", e.strerror or e)
                if not self._evict():
                    self._pause(now + 0.1)
                return
            sock.setblocking(False)
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn = _Connection(sock, address, now)
            self._conns[conn.fd] = conn
            self._selector.register(sock, selectors.EVENT_READ, conn)
            if full:
                self._evict()  # an older idle one: checked above

    def _pause(self, until: float) -> None:
        if self._listening:
            self._selector.unregister(self.listener)
            self._listening = False
        self._resume_at = until

    def _evict(self) -> bool:
        """Close the longest idle connection (no request pending); False if none is idle."""
        idle = [c for c in self._idle() if not c.buf]
        if not idle:
            return False
        oldest = min(idle, key=lambda c: c.since)
        log.debug("sdpa view: %s closed to make room (idle)", oldest.name())
        self._close(oldest)
        return True

    def _idle(self) -> list[_Connection]:
        """The connections waiting in the selector (not being answered)."""
        return [k.data for k in self._selector.get_map().values() if k.data is not None]

    def _read(self, conn: _Connection, now: float) -> None:
        try:
            data = conn.sock.recv(65536)
        except BlockingIOError:
            return
        except OSError as e:  # reset by the client
            log.debug("sdpa view: %s went away (%s)", conn.name(), type(e).__name__)
            self._close(conn)
            return
        if not data:
            if conn.buf:
                log.debug("sdpa view: %s closed in the middle of a request", conn.name())
            self._close(conn)
            return
        if not conn.buf:
            conn.since = now  # the head's first byte
        conn.buf += data
        if head_end(conn.buf) >= 0 or len(conn.buf) >= MAX_HEAD:
            self._dispatch(conn)

    def _dispatch(self, conn: _Connection) -> None:
        self._selector.unregister(conn.sock)
        self._pool.submit(self._work, conn)

    def _take_back(self, now: float) -> None:
        with contextlib.suppress(OSError):
            while self._wake_r.recv(4096):
                pass
        while self._returned:
            conn, keep = self._returned.popleft()
            if not keep or self._shutdown:
                self._close(conn, registered=False)
            elif head_end(conn.buf) >= 0 or len(conn.buf) >= MAX_HEAD:  # pipelined
                self._pool.submit(self._work, conn)
            else:
                conn.since = now
                self._selector.register(conn.sock, selectors.EVENT_READ, conn)
                self._room()  # an idle connection can make room

    def _sweep(self, now: float) -> None:
        """Close the connections idle past idle_timeout, or whose head is overdue."""
        for conn in self._idle():
            if conn.buf and now - conn.since > self.head_timeout:
                log.debug("sdpa view: %s sent no complete request in time", conn.name())
                self._close(conn)
            elif not conn.buf and now - conn.since > self.idle_timeout:
                self._close(conn)

    def _close(self, conn: _Connection, registered: bool = True) -> None:
        if registered:
            self._selector.unregister(conn.sock)
        conn.sock.close()
        self._conns.pop(conn.fd, None)
        self._room()

    def _room(self) -> None:
        """A connection closed or went idle: a listener paused for want of room resumes."""
        if not self._listening and self._resume_at == float("inf"):
            self._resume_at = 0.0

    def _wake(self) -> None:
        with contextlib.suppress(OSError):  # full (a wake is pending anyway) or closed
            self._wake_w.send(b"x")

    # a worker thread's work

    def _work(self, conn: _Connection) -> None:
        """Answer the first request in conn.buf, then hand the connection back."""
        keep = False
        try:
            end = head_end(conn.buf)
            cut = end if 0 <= end <= MAX_HEAD else MAX_HEAD
            head = bytes(conn.buf[:cut])
            del conn.buf[:cut]
            data, keep = self.respond(head, conn.address)
            keep = keep and end >= 0
            conn.sock.settimeout(self.write_timeout)
            conn.sock.sendall(data)
            conn.sock.setblocking(False)
        except (ConnectionError, TimeoutError) as e:  # broken pipe, reset, a client not reading
            log.debug("sdpa view: %s went away before its answer (%s)", conn.name(),
                      type(e).__name__)  # fmt: skip
            keep = False
        except Exception:  # a bug of ours: logged, and the connection closed
            log.exception("sdpa view: answering %s failed", conn.name())
            keep = False
        finally:
            self._returned.append((conn, keep))
            self._wake()
