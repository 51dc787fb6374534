"""A tracking or registry URI that names a server: checked within seconds, and never shown with its credentials.

MLflow retries a request to an unreachable server seven times with exponential backoff (about four minutes),
and then raises an error quoting the request URL whole, user:password@ included. `check_reachable` connects to
the server's port once, with a timeout of PROBE_TIMEOUT_S, before MLflow is asked anything, and fails with
`TrackingUnavailable` naming the URI as redacted_uri shows it (resources/secrets.py). `redacting` wraps the
MLflow client (and any call) so that every error it raises reaches the caller with the URIs' credentials, in any
encoding (a server may echo the Authorization header back, base64-encoded), replaced by ***: raised anew, with
no chained error that could still quote them.
"""

from __future__ import annotations

import socket
import urllib.request
from collections.abc import Callable, Iterable
from typing import Any, TypeVar
from urllib.parse import unquote, urlsplit

from covlab.resources.secrets import redact, redacted_uri, url_secrets

T = TypeVar("T")
# How long the reachability probe waits for a TCP connection to the tracking server.
PROBE_TIMEOUT_S = 3.0
SERVER_SCHEMES = {"http": 80, "https": 443}


class TrackingUnavailable(RuntimeError):
    """The MLflow tracking or registry URI cannot be used: its server does not answer, or MLflow refused the URI.
    The message names the URI with its credentials redacted."""


def uri_secrets(*uris: str | None) -> list[str]:
    """The credentials in `uris` as text may show them (url_secrets of each), plus their user:password as
    sent in a Basic Authorization header (decoded), whose base64 form `redact` also finds."""
    found = []
    for uri in uris:
        if not uri:
            continue
        found += url_secrets(uri)
        userinfo = urlsplit(uri).netloc.rpartition("@")[0]
        if ":" in userinfo:
            user, _, password = userinfo.partition(":")
            found.append(f"{unquote(user)}:{unquote(password)}")
    return found


def check_reachable(uri: str, timeout_s: float = PROBE_TIMEOUT_S) -> None:
    """Nothing when `uri` is not an http(s) server URI, or its server accepts a TCP connection within
    `timeout_s` (or a proxy is configured for it, which the probe cannot go through); else TrackingUnavailable
    naming the redacted URI, what failed and what to do."""
    try:
        parts = urlsplit(uri)
        host, port = parts.hostname, parts.port or SERVER_SCHEMES.get(parts.scheme)
    except ValueError as exc:  # a port that is not a number, an unbalanced [ ... in the host
        raise TrackingUnavailable(f"MLflow tracking URI {redacted_uri(uri)!r} is not a valid URI ({exc}); expected "
                                  "e.g. http://host:5000, sqlite:////path/mlflow.db or postgresql://user@host/db"
                                  ) from None
    if parts.scheme not in SERVER_SCHEMES or not host:
        return
    proxies = urllib.request.getproxies()
    if parts.scheme in proxies and not urllib.request.proxy_bypass(host):
        return
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return
    except OSError as exc:
        reason = f"no answer within {timeout_s:g} s" if isinstance(exc, TimeoutError) else str(exc)
    raise TrackingUnavailable(  # outside the except block: nothing chained
        f"the MLflow tracking server {redacted_uri(uri)} is not reachable ({host} port {port}: {reason}); start it "
        "(mlflow server ...) or point covlab at another one (--tracking-uri, COVLAB_MLFLOW_TRACKING_URI)")


def redacted_error(error: BaseException, secrets: Iterable[str]) -> BaseException | None:
    """A new error saying what `error` says with `secrets` (in any encoding) replaced by ***, of MLflow's own
    type for an MlflowException (its error code kept, which callers test), else TrackingUnavailable; None when
    `error` quotes none of them."""
    secrets = [secret for secret in secrets if secret]
    text = str(error)
    shown = redact(text, secrets)
    if shown == text:
        return None
    from mlflow.exceptions import MlflowException
    from mlflow.protos.databricks_pb2 import ErrorCode

    if isinstance(error, MlflowException):
        try:
            code = ErrorCode.Value(error.error_code)
        except ValueError:
            code = ErrorCode.Value("INTERNAL_ERROR")
        return MlflowException(shown, error_code=code)
    return TrackingUnavailable(f"{type(error).__name__}: {shown}")


def call_redacted(secrets: list[str], function: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """`function(*args, **kwargs)`; an error it raises that quotes any of `secrets` is raised as
    `redacted_error` made it, without the original chained to it."""
    try:
        return function(*args, **kwargs)
    except Exception as exc:
        error = redacted_error(exc, secrets)
        if error is None:
            raise
    raise error  # outside the except block: nothing chained (__context__ None) that quotes a secret


def opening(uri: str, secrets: list[str], function: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """`function(*args, **kwargs)`, a step of opening the MLflow store at `uri`: an MlflowException it raises (a
    URI MLflow refuses, a server that refused or failed) is raised as TrackingUnavailable naming the redacted URI
    and saying what MLflow said, redacted."""
    from mlflow.exceptions import MlflowException

    try:
        return function(*args, **kwargs)
    except MlflowException as exc:
        error = TrackingUnavailable(f"MLflow cannot open the tracking store {redacted_uri(uri)}: "
                                    f"{redact(str(exc), secrets)}")
    raise error  # outside the except block: nothing chained that quotes a secret


class RedactingClient:
    """An MlflowClient whose every method raises its errors through `call_redacted`."""

    def __init__(self, client: Any, secrets: list[str]):
        self._client, self._secrets = client, secrets

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(self._client, name)
        if not callable(attribute):
            return attribute

        def call(*args: Any, **kwargs: Any) -> Any:
            return call_redacted(self._secrets, attribute, *args, **kwargs)

        return call


def redacting(client: Any, secrets: list[str]) -> Any:
    """`client` itself when there is no secret to hide, else a RedactingClient around it."""
    return RedactingClient(client, secrets) if secrets else client
