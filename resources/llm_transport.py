"""How the LLM resource (resources/llm.py) talks HTTP: one POST of a chat completion, read within limits that hold
whatever the server does, on an event loop thread of the resource's own.

A response is streamed. `timeout_s` is a deadline for a whole attempt: connecting, sending, the status line, the
headers and the body. httpx's own timeouts bound each socket read, which a server trickling bytes (of its headers
or its body) never trips, and httpx has no total timeout; so each attempt runs as a coroutine on the transport's
event loop thread under `asyncio.wait_for`, which cancels it, wherever it is, when `timeout_s` has passed
(`DeadlineExceeded`). And at most `max_response_bytes` of a body are read (of an error body only the first
ERROR_BODY_BYTES, for the message), so memory does not grow with what the server sends.

Credentials in the endpoint URL (http://user:password@host/v1) are taken out of it and sent as basic auth
(`split_credentials`), so neither the request line nor httpx's own log line naming the URL carries them, and every
message shows the URL as http://***@host/v1 (`display_url`). The API key goes in the Authorization header only.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from email.utils import parsedate_to_datetime
from urllib.parse import unquote, urlsplit, urlunsplit

import httpx

RETRYABLE_STATUS = frozenset({408, 429, *range(500, 600)})
ERROR_BODY_BYTES = 64 * 1024  # how much of an error status's body is read: far more than a message quotes


class DeadlineExceeded(Exception):
    """An attempt had not received its whole response when its `timeout_s` deadline passed."""


@dataclass(frozen=True)
class Received:
    """One response as far as it was read."""

    status: int
    headers: httpx.Headers
    body: bytes | bytearray
    complete: bool  # False: the body went past its byte limit and `body` is only its beginning
    encoding: str

    @property
    def text(self) -> str:
        return self.body.decode(self.encoding, errors="replace")


def display_url(url: str) -> str:
    """`url` as messages and metadata show it: any user:password@ replaced by ***@."""
    parts = urlsplit(url)
    if "@" not in parts.netloc:
        return url
    return urlunsplit(parts._replace(netloc=f"***@{parts.netloc.rpartition('@')[2]}"))


def split_credentials(url: str) -> tuple[str, httpx.BasicAuth | None]:
    """`url` without its user:password@, and those as the basic auth httpx would derive from them: so the
    request, and httpx's own log line naming its URL, carry no credentials."""
    parts = urlsplit(url)
    userinfo, at, host = parts.netloc.rpartition("@")
    if not at:
        return url, None
    username, _, password = userinfo.partition(":")
    return urlunsplit(parts._replace(netloc=host)), httpx.BasicAuth(unquote(username), unquote(password))


def retry_after_s(headers: httpx.Headers) -> float | None:
    """Seconds asked for by a Retry-After header (seconds or an HTTP date); None when absent or unreadable."""
    value = headers.get("retry-after")
    if value is None:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        return max(0.0, (parsedate_to_datetime(value) - datetime.now(timezone.utc)).total_seconds())
    except (TypeError, ValueError):
        return None


class ChatTransport:
    """The event loop thread the requests run on, the HTTP client they share and the semaphore of requests in
    flight (at most `concurrency`), all opened on first use, and again in a forked child (which has no loop
    thread)."""

    def __init__(self, timeout_s: float, max_response_bytes: int, concurrency: int, api_key: str | None):
        self.timeout_s, self.max_response_bytes, self.concurrency = timeout_s, max_response_bytes, concurrency
        self._api_key = api_key
        self._lock = threading.Lock()
        self._http: httpx.AsyncClient | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: threading.Thread | None = None
        self._loop_pid: int | None = None
        self._slots = threading.BoundedSemaphore(concurrency)

    def __repr__(self) -> str:  # never the key
        return f"ChatTransport(timeout_s={self.timeout_s}, concurrency={self.concurrency})"

    def post(self, url: str, auth: httpx.BasicAuth | None, payload: dict, sending: Callable[[], None] = lambda: None
             ) -> Received:
        """The response to POSTing `payload` to `url`, once a slot is free (`sending` is called then); raises
        httpx.TransportError, or DeadlineExceeded when the whole response was not in within `timeout_s`."""
        loop, client = self._open()
        with self._slots:
            sending()
            return asyncio.run_coroutine_threadsafe(self._receive(client, url, auth, payload), loop).result()

    def close(self) -> None:
        """Close the HTTP connections and stop the event loop thread (they reopen on the next post)."""
        with self._lock:
            if self._loop is not None:
                if self._http is not None:
                    asyncio.run_coroutine_threadsafe(self._http.aclose(), self._loop).result()
                self._loop.call_soon_threadsafe(self._loop.stop)
                self._loop_thread.join()
                self._loop.close()
                self._http, self._loop, self._loop_thread = None, None, None

    def _open(self) -> tuple[asyncio.AbstractEventLoop, httpx.AsyncClient]:
        with self._lock:
            if self._loop is not None and self._loop_pid != os.getpid():  # a forked child has no loop thread
                self._http, self._loop, self._loop_thread = None, None, None
            if self._loop is None:
                self._loop, self._loop_pid = asyncio.new_event_loop(), os.getpid()
                self._loop_thread = threading.Thread(target=self._loop.run_forever, name="covlab-llm-http",
                                                     daemon=True)
                self._loop_thread.start()
            if self._http is None:
                # Uncompressed bodies: then no small compressed chunk can inflate far past max_response_bytes.
                headers = {"Accept-Encoding": "identity"}
                if self._api_key:
                    headers["Authorization"] = f"Bearer {self._api_key}"
                self._http = httpx.AsyncClient(timeout=self.timeout_s, headers=headers,
                                               limits=httpx.Limits(max_connections=self.concurrency))
            return self._loop, self._http

    async def _receive(self, client: httpx.AsyncClient, url: str, auth: httpx.BasicAuth | None,
                       payload: dict) -> Received:
        """POST `payload` and read the response, all within `timeout_s` (else DeadlineExceeded): connecting,
        the status line and headers and the body, however slowly each byte arrives."""
        try:
            return await asyncio.wait_for(self._stream(client, url, auth, payload), self.timeout_s)
        except TimeoutError:
            raise DeadlineExceeded from None

    async def _stream(self, client: httpx.AsyncClient, url: str, auth: httpx.BasicAuth | None,
                      payload: dict) -> Received:
        """The response to `payload`, streamed: a 200 body is read up to `max_response_bytes`, any other
        status's up to ERROR_BODY_BYTES; past its limit reading stops and the connection is dropped, with
        `complete` False."""
        async with client.stream("POST", url, json=payload, auth=auth) as response:
            status = response.status_code
            limit = self.max_response_bytes if status == 200 else min(ERROR_BODY_BYTES, self.max_response_bytes)
            declared = response.headers.get("content-length", "")
            body = bytearray()
            complete = not (status == 200 and declared.isdigit() and int(declared) > limit)  # else: not read
            if complete:
                async for chunk in response.aiter_bytes():
                    body += chunk
                    if len(body) > limit:
                        del body[limit:]
                        complete = False
                        break
            return Received(status, response.headers, body, complete, response.encoding or "utf-8")
