"""`covlab serve`'s connections over real sockets on 127.0.0.1, with uvicorn run as `covlab serve` runs it
(serving/http.py server_options) and short deadlines set here: a connection that sends no complete request headers
within --header-seconds is closed, a body that does not arrive in full within --body-seconds is answered 408, a
connection beyond --max-connections is answered 503 and closed at once, and a prompt client is unaffected; 300 idle
sockets against a server limited to 256 open files leave /healthz answering."""

import json
import resource
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path

import pytest
import uvicorn

from covlab.models.registry import SelectorSettings, method
from covlab.models.tokens import TokenCounter
from covlab.serving.http import Limits, ServedMethods, ServeSettings, create_app, server_options
from covlab.serving.selector import ContextSelector
from fixed_encoder import FixedEncoder

ROOT = Path(__file__).resolve().parents[1]
COUNTER = TokenCounter()
REQUEST = json.dumps({"method": "mmr", "query": "When does the market open?", "budget": {"k": 1},
                      "candidates": ["The market opens at dawn.", "Trams run until midnight."]}).encode()
HEAD = (b"POST /v1/select HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n" % len(REQUEST))
SHORT = Limits(header_seconds=0.5, body_seconds=0.5, max_connections=4)


def selector(name: str) -> ContextSelector:
    return ContextSelector(method(name), SelectorSettings(), FixedEncoder(), COUNTER)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@contextmanager
def running(limits: Limits):
    """A uvicorn server of covlab serve's app and options under `limits`, on a thread; its port."""
    app = create_app(ServedMethods(["mmr"], selector, lambda name, alias: None), limits=limits)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, **server_options(ServeSettings(port=port, limits=limits))))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.02)
    try:
        yield port
    finally:
        server.should_exit = True
        thread.join(timeout=15)


def connect(port: int) -> socket.socket:
    connection = socket.create_connection(("127.0.0.1", port), timeout=10)
    connection.settimeout(10)
    return connection


def closed_by_server(connection: socket.socket, within: float) -> bool:
    """Whether the server closes `connection` within `within` seconds (what it sent before is read and dropped)."""
    connection.settimeout(within)
    try:
        while connection.recv(65536):
            pass
        return True
    except (TimeoutError, socket.timeout):
        return False
    except ConnectionResetError:
        return True


def answer(connection: socket.socket) -> bytes:
    """One whole HTTP answer read from `connection` (its head and a Content-Length body)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = connection.recv(65536)
        assert chunk, data
        data += chunk
    head, rest = data.split(b"\r\n\r\n", 1)
    length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length")))
    while len(rest) < length:
        chunk = connection.recv(65536)
        assert chunk
        rest += chunk
    return head + b"\r\n\r\n" + rest


def healthz(port: int) -> int:
    return urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5).status


def test_an_idle_connection_is_closed_after_the_header_deadline():
    with running(SHORT) as port:
        connection = connect(port)
        started = time.monotonic()
        assert closed_by_server(connection, within=5)
        assert 0.4 < time.monotonic() - started < 3
        connection.close()


def test_headers_sent_a_byte_at_a_time_are_cut_at_the_header_deadline():
    with running(SHORT) as port:
        connection = connect(port)
        started, sent = time.monotonic(), 0
        try:
            for byte in HEAD:  # 0.05 s a byte: the head would take ~5 s
                connection.sendall(bytes([byte]))
                sent += 1
                if closed_by_server(connection, within=0.05):
                    break
        except (BrokenPipeError, ConnectionResetError):
            pass
        took = time.monotonic() - started
        connection.close()
    assert sent < len(HEAD) and took < 0.5 + 2, (sent, took)


def test_a_body_sent_a_byte_at_a_time_is_answered_408_at_the_body_deadline():
    with running(SHORT) as port:
        connection = connect(port)
        connection.sendall(HEAD)
        started, reply = time.monotonic(), b""
        for byte in REQUEST:  # 0.05 s a byte: the body would take ~7 s
            try:
                connection.sendall(bytes([byte]))
            except (BrokenPipeError, ConnectionResetError):
                break
            connection.settimeout(0.05)
            try:
                reply += connection.recv(65536)
            except (TimeoutError, socket.timeout):
                continue
            if reply:
                break
        connection.settimeout(5)
        while b"\r\n\r\n" not in reply:
            reply += connection.recv(65536)
        took = time.monotonic() - started
        assert reply.startswith(b"HTTP/1.1 408 "), reply
        assert b"request body: not received in full within 0.5 s (covlab serve --body-seconds)" in reply, reply
        assert closed_by_server(connection, within=5)
        connection.close()
    assert took < 0.5 + 2


def test_connections_beyond_the_limit_are_answered_503_at_once_and_a_prompt_client_is_unaffected():
    with running(SHORT) as port:
        prompt = connect(port)
        for _ in range(3):  # one keep-alive connection, three requests, each well within the deadlines
            prompt.sendall(HEAD + REQUEST)
            assert answer(prompt).startswith(b"HTTP/1.1 200 ")
        idle = [connect(port) for _ in range(3)]  # with the prompt one: the limit of 4
        time.sleep(0.1)
        extra = connect(port)
        started = time.monotonic()
        reply = extra.recv(65536)
        assert reply.startswith(b"HTTP/1.1 503 "), reply
        assert b"connections: 4 open, the limit (covlab serve --max-connections)" in reply
        assert closed_by_server(extra, within=2) and time.monotonic() - started < 1
        for connection in idle:  # cut at the header deadline: new connections are taken again
            assert closed_by_server(connection, within=5)
        prompt.close()
        time.sleep(0.1)
        assert healthz(port) == 200
        for connection in [*idle, extra]:
            connection.close()


SERVER = """
import sys
sys.path.insert(0, sys.argv[2])
import uvicorn
from covlab.models.registry import SelectorSettings, method
from covlab.models.tokens import TokenCounter
from covlab.serving.http import Limits, ServedMethods, ServeSettings, create_app, server_options
from covlab.serving.selector import ContextSelector
from fixed_encoder import FixedEncoder

limits = Limits(header_seconds=1.0)  # the default connection limit
served = ServedMethods(["mmr"], lambda name: ContextSelector(method(name), SelectorSettings(), FixedEncoder(),
                                                             TokenCounter()), lambda name, alias: None)
uvicorn.run(create_app(served, limits=limits), **server_options(ServeSettings(port=int(sys.argv[1]), limits=limits)))
"""


@pytest.mark.slow
def test_300_idle_sockets_leave_healthz_answering_a_server_limited_to_256_open_files():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 400:
        pytest.skip(f"this process may open at most {hard} files; the test opens 300 sockets")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1024) if hard == resource.RLIM_INFINITY
                                                else min(max(soft, 1024), hard), hard))
    port = free_port()
    server = subprocess.Popen([sys.executable, "-c", SERVER, str(port), str(ROOT / "tests")],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256)))
    idle = []
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                assert healthz(port) == 200
                break
            except OSError:
                assert server.poll() is None and time.monotonic() < deadline, "the server did not start"
                time.sleep(0.1)
        idle = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(300)]
        time.sleep(0.2)
        answered, deadline = None, time.monotonic() + 15  # the header deadline (1 s) and a margin
        while answered is None and time.monotonic() < deadline:
            try:
                answered = healthz(port)
            except OSError:
                time.sleep(0.2)
        assert answered == 200, "healthz did not answer while 300 idle sockets were open"
        assert server.poll() is None
    finally:
        for connection in idle:
            connection.close()
        server.terminate()
        log = server.communicate(timeout=30)[0]
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert "Too many open files" not in log, log[-3000:]
