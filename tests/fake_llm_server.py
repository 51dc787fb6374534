"""A real HTTP server speaking OpenAI's POST /v1/chat/completions, for testing the LLM resource.

It runs the standard library's threading HTTP server in a background thread on 127.0.0.1 (a free port) and
answers each request with the next scripted `Reply` (an answer, an HTTP error with an optional Retry-After, a
hang past the client's timeout, a body that is not a completion, a body trickled a byte at a time, a status
line and headers trickled a byte at a time, a huge body streamed in chunks that are never all in memory at
once), falling back to a `responder` function once the
script is used up. Every request is recorded with its headers (Authorization included, so a test can see
that the key was sent), its JSON body and its arrival time; the most requests ever in flight at once is kept.
"""

from __future__ import annotations

import json
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

CHAT_PATH = "/v1/chat/completions"


@dataclass(frozen=True)
class Reply:
    """One scripted response: a completion whose message is `content` (status 200), or `status` with `body`."""

    status: int = 200
    content: str = ""
    body: str | None = None  # sent as-is instead of a completion envelope
    headers: dict[str, str] = field(default_factory=dict)
    delay_s: float = 0.0  # sleep before answering; past the client's timeout it is a timeout
    stream_bytes: int = 0  # > 0: instead of a body, this many filler bytes, written chunk by chunk
    chunk_bytes: int = 1 << 20
    chunk_interval_s: float = 0.0  # sleep between streamed chunks
    declare_length: bool = True  # send Content-Length for a streamed body (else it ends when the socket closes)
    usage: dict | None = None  # the completion's `usage` ({"prompt_tokens": n, "completion_tokens": m}); None: absent
    head_interval_s: float = 0.0  # > 0: the status line and headers are written one byte every this many seconds
    head_padding: int = 0  # bytes of an extra header, to make a trickled head last

    @classmethod
    def answer(cls, content: str, delay_s: float = 0.0, usage: dict | None = None) -> Reply:
        return cls(content=content, delay_s=delay_s, usage=usage)

    @classmethod
    def error(cls, status: int, body: str = "fake server error", retry_after: str | None = None) -> Reply:
        return cls(status=status, body=body, headers={"Retry-After": retry_after} if retry_after else {})

    @classmethod
    def hang(cls, seconds: float, content: str = "late") -> Reply:
        return cls(content=content, delay_s=seconds)

    @classmethod
    def garbage(cls, body: str = "<html>not a completion</html>") -> Reply:
        return cls(body=body)

    @classmethod
    def trickle(cls, total_bytes: int, interval_s: float, status: int = 200) -> Reply:
        """Headers at once, then the body one byte every `interval_s`: no single read ever waits long."""
        return cls(status=status, stream_bytes=total_bytes, chunk_bytes=1, chunk_interval_s=interval_s)

    @classmethod
    def slow_head(cls, interval_s: float, padding: int = 10_000, content: str = "late") -> Reply:
        """The status line and headers one byte every `interval_s` (with a `padding`-byte header, so that they
        last), then a completion: a client whose timeouts bound each read never times out."""
        return cls(content=content, head_interval_s=interval_s, head_padding=padding)

    @classmethod
    def huge(cls, total_bytes: int, status: int = 200, declare_length: bool = True) -> Reply:
        """A body of `total_bytes` filler bytes, streamed in 1 MiB chunks."""
        return cls(status=status, stream_bytes=total_bytes, declare_length=declare_length)


@dataclass(frozen=True)
class RecordedRequest:
    path: str
    headers: dict[str, str]
    body: dict | None
    arrived: float  # time.monotonic() when the body had been read

    @property
    def messages(self) -> list[dict]:
        return (self.body or {}).get("messages", [])


class FakeLLMServer:
    """Context manager: `with FakeLLMServer(responder) as server: ... server.url ...`."""

    def __init__(self, responder: Callable[[dict], Reply] | None = None):
        self.responder = responder
        self._script: deque[Reply] = deque()
        self._requests: list[RecordedRequest] = []
        self._lock = threading.Lock()
        self._in_flight = 0
        self.max_in_flight = 0
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler_class())
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05},
                                        name="fake-llm", daemon=True)

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}/v1"

    @property
    def requests(self) -> list[RecordedRequest]:
        with self._lock:
            return list(self._requests)

    def script(self, *replies: Reply) -> None:
        with self._lock:
            self._script.extend(replies)

    def __enter__(self) -> FakeLLMServer:
        self._thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()

    def _next_reply(self, body: dict) -> Reply:
        with self._lock:
            if self._script:
                return self._script.popleft()
        if self.responder is not None:
            return self.responder(body)
        return Reply.error(500, "fake server: no reply scripted and no responder")

    def _handler_class(self) -> type[BaseHTTPRequestHandler]:
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's naming)
                raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                try:
                    body = json.loads(raw)
                except ValueError:
                    body = None
                with server._lock:
                    server._requests.append(RecordedRequest(self.path, dict(self.headers.items()), body,
                                                            time.monotonic()))
                    server._in_flight += 1
                    server.max_in_flight = max(server.max_in_flight, server._in_flight)
                try:
                    if self.path != CHAT_PATH or body is None:
                        reply = Reply.error(404 if self.path != CHAT_PATH else 400, f"cannot serve {self.path}")
                    else:
                        reply = server._next_reply(body)
                    time.sleep(reply.delay_s)
                finally:
                    # Counted out before answering, so the client cannot start its next request first.
                    with server._lock:
                        server._in_flight -= 1
                self._send(reply, body or {})

            def _send(self, reply: Reply, body: dict) -> None:
                if reply.stream_bytes:
                    self._stream(reply)
                    return
                if reply.body is not None:
                    payload = reply.body.encode("utf-8")
                else:
                    payload = json.dumps({
                        "id": "chatcmpl-fake", "object": "chat.completion", "created": int(time.time()),
                        "model": body.get("model", ""),
                        "choices": [{"index": 0, "finish_reason": "stop",
                                     "message": {"role": "assistant", "content": reply.content}}],
                        **({"usage": reply.usage} if reply.usage is not None else {}),
                    }).encode("utf-8")
                try:
                    if reply.head_interval_s:
                        self._trickle_head(reply, payload)
                        return
                    self.send_response(reply.status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(payload)))
                    for name, value in reply.headers.items():
                        self.send_header(name, value)
                    self.end_headers()
                    self.wfile.write(payload)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client gave up (a scripted timeout)

            def _trickle_head(self, reply: Reply, payload: bytes) -> None:
                head = (f"HTTP/1.1 {reply.status} OK\r\nContent-Type: application/json\r\n"
                        f"X-Padding: {'p' * reply.head_padding}\r\nContent-Length: {len(payload)}\r\n\r\n")
                for byte in head.encode("ascii"):
                    self.wfile.write(bytes([byte]))
                    time.sleep(reply.head_interval_s)
                self.wfile.write(payload)

            def _stream(self, reply: Reply) -> None:
                chunk = b"x" * reply.chunk_bytes
                try:
                    self.send_response(reply.status)
                    self.send_header("Content-Type", "application/json")
                    if reply.declare_length:
                        self.send_header("Content-Length", str(reply.stream_bytes))
                    self.end_headers()
                    for start in range(0, reply.stream_bytes, reply.chunk_bytes):
                        if start:
                            time.sleep(reply.chunk_interval_s)
                        self.wfile.write(chunk[:reply.stream_bytes - start])
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client stopped reading (a deadline or a size limit)

            def log_message(self, format: str, *args) -> None:  # noqa: A002 (http.server's signature)
                pass

        return Handler
