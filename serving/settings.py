"""`covlab serve`'s settings that its command line offers: the address, the polling and shutdown times, the token
variable and the limits of a request (`Limits`). Their home is here, apart from serving/http.py, so that the CLI
builds its parser without loading the service (FastAPI, torch, the models)."""

import math
from dataclasses import dataclass, field, fields

DEFAULT_HOST, DEFAULT_PORT = "127.0.0.1", 8080
DEFAULT_POLL_SECONDS = 30.0
DEFAULT_SHUTDOWN_SECONDS = 5.0  # how long the requests in flight at SIGTERM may take to finish (serving/http.py)
# The environment variable holding the bearer token every request but GET /healthz must carry (none: no token asked).
TOKEN_VARIABLE = "COVLAB_SERVE_TOKEN"


@dataclass(frozen=True)
class Limits:
    """What one request may hold and take, and how many connections may be open: each field is the `covlab serve`
    flag of its name (`flag`), described by its `help`, and /v1/methods lists them. A text the encoder reads only
    the beginning of is served, and named in the answer's `over_encoder_limit`; one over `max_text_chars` is
    refused."""
    max_body_bytes: int = field(default=8 * 2**20, metadata={"help": "largest request body, in bytes; larger: 413"})
    max_candidates: int = field(default=1_000, metadata={"help": "most candidates per request"})
    max_text_chars: int = field(default=20_000, metadata={"help": "longest query or candidate text, in characters"})
    max_subquestions: int = field(default=64, metadata={"help": "most subquestions per request"})
    max_pairs: int = field(default=20_000, metadata={
        "help": "most candidates x subquestions pairs per request, each scored by the coverage estimator"})
    header_seconds: float = field(default=10.0, metadata={
        "help": "how long a connection may take to send a request's headers, from its opening or the end of the "
                "previous answer: an idle or trickling connection is closed"})
    body_seconds: float = field(default=30.0, metadata={
        "help": "how long a request's body may take to arrive in full after its headers; longer: 408"})
    max_connections: int = field(default=128, metadata={
        "help": "most connections open at once; one more is answered 503 and closed (keep it below ulimit -n)"})

    def __post_init__(self):
        for setting in fields(self):
            value = getattr(self, setting.name)
            if setting.type is int and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{setting.name}: expected a positive whole number, got {value!r}")
            if setting.type is float and (isinstance(value, bool) or not isinstance(value, (int, float))
                                          or not (math.isfinite(value) and value > 0)):
                raise ValueError(f"{setting.name}: expected a finite number of seconds > 0, got {value!r}")


def flag(setting: str) -> str:
    """The `covlab serve` flag of a Limits field, as refusals name it: max_pairs -> "covlab serve --max-pairs"."""
    return f"covlab serve --{setting.replace('_', '-')}"
