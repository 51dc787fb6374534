"""Finding a secret in text in any of the forms text commonly carries it, so that it can be redacted.

A server that echoes a request back (an error body quoting the Authorization header, a JSON document of the
request) rarely quotes the secret as it was sent: JSON escapes `/` as `\\/` or any character as `\\u00XX`,
URLs percent-encode it (once, or twice), HTML writes `&#47;`, Basic auth and many logs base64-encode it, some
lowercase or uppercase whole messages, and hex dumps show its bytes. `secret_pattern` matches every one of
these forms of each secret, and any mix of the per-character ones, so that `redact` leaves no form behind.

Base64 has no fixed image of a secret embedded in longer text (`Basic base64(user:password)`): its
characters depend on where the secret falls in a 3-byte group. For each of the three alignments the
characters that depend on the secret's bytes alone are matched; at most two bytes' worth of characters at
either end are left, which cannot reveal the secret.
"""

from __future__ import annotations

import base64
import os
import re
from collections.abc import Iterable, Mapping
from urllib.parse import unquote, urlsplit, urlunsplit

# Secrets shorter than this are matched case-sensitively and without their base64 and hex images: matching
# a 4-character password case-insensitively would blank unrelated words.
MIN_FOLDED_LENGTH = 8
# Shortest base64 or hex image matched (shorter ones are too likely to occur by chance).
MIN_IMAGE_LENGTH = 8
# Environment variables whose values are secrets: COVLAB_LLM_API_KEY, HF_TOKEN, AWS_SECRET_ACCESS_KEY (not
# TOKENIZERS_PARALLELISM).
SECRET_ENV_PATTERN = r"(?i)(^|_)(api_?key|key|token|secret|password|passwd|credentials?)(_|$)"
# URI query parameters whose values are secrets: ?token=, ?api_key=, ?password=, ?sig= (a signed URL).
SECRET_QUERY_PATTERN = r"(?i)(^|[_-])(api_?key|key|token|secret|password|passwd|pwd|credentials?|sig|signature)$"


def _hex(number: int, digits: int = 2) -> str:
    """A pattern for `number` in hex (at least `digits` digits), each digit in upper or lower case."""
    return "".join(f"[{d}{d.upper()}]" if d.isalpha() else d for d in f"{number:0{digits}x}")


def _character(char: str, folded: bool) -> str:
    """A pattern for one character of a secret in any per-character encoding: as itself (any case when
    `folded`) behind any backslashes (JSON's `\\/`), as a JSON/JavaScript `\\uXXXX` escape, percent-encoded
    once or twice, as an HTML character reference, and a space also as `+`."""
    plain = re.escape(char)
    if folded and char.lower() != char.upper():
        plain = f"[{re.escape(char.lower())}{re.escape(char.upper())}]"
    code = ord(char)
    units = [code] if code < 0x10000 else [0xD800 + ((code - 0x10000) >> 10), 0xDC00 + ((code - 0x10000) & 0x3FF)]
    escaped = "".join(r"\\+[uU]" + _hex(unit, 4) for unit in units)
    percent = "".join(f"%(?:25)?{_hex(byte)}" for byte in char.encode("utf-8"))
    forms = [rf"\\*{plain}", escaped, percent, f"&#0*{code};", f"&#[xX]0*{_hex(code, 1)};"]
    if char == " ":
        forms.append(r"\+")
    return f"(?:{'|'.join(forms)})"


def _base64_images(secret: bytes) -> list[str]:
    """The base64 characters that depend on `secret`'s bytes alone, for each of its three alignments in a
    longer encoded text, in the standard and the URL-safe alphabet."""
    images = []
    for offset in range(3):
        encoded = base64.b64encode(bytes(offset) + secret).decode("ascii")
        end = (offset + len(secret)) // 3 * 4  # groups after this hold bytes that follow the secret
        start = 4 if offset else 0  # the first group then holds bytes that precede it
        image = encoded[start:end]
        if len(image) >= MIN_IMAGE_LENGTH:
            images += [image, image.replace("+", "-").replace("/", "_")]
    return images


def secret_pattern(secrets: Iterable[str | None]) -> re.Pattern | None:
    """One pattern matching every secret in `secrets` (empty ones ignored) in every form the module
    docstring lists; None when there is none to match."""
    alternatives = []
    for secret in sorted({s for s in secrets if s}, key=len, reverse=True):
        folded = len(secret) >= MIN_FOLDED_LENGTH
        alternatives.append("".join(_character(char, folded) for char in secret))
        if folded:
            raw = secret.encode("utf-8")
            images = [*_base64_images(raw), raw.hex()]
            alternatives += [f"(?i:{re.escape(image)})" for image in images if len(image) >= MIN_IMAGE_LENGTH]
    return re.compile("|".join(alternatives)) if alternatives else None


def redact(text: str, secrets: Iterable[str | None], replacement: str = "***") -> str:
    """`text` with every form of every secret replaced by `replacement`."""
    pattern = secret_pattern(secrets)
    return text if pattern is None else pattern.sub(replacement, text)


def contains_secret(text: str, secrets: Iterable[str | None]) -> bool:
    """Whether `text` holds any form of any of `secrets`."""
    pattern = secret_pattern(secrets)
    return pattern is not None and pattern.search(text) is not None


def url_secrets(url: str) -> list[str]:
    """The credentials in `url` as they may appear in text: the whole userinfo (user:password, or a lone
    token as in https://TOKEN@host), and the password as written and percent-decoded."""
    userinfo = urlsplit(url).netloc.rpartition("@")[0]
    password = userinfo.partition(":")[2]
    return [secret for secret in (userinfo, password, unquote(password)) if secret]


def redacted_uri(uri: str | None) -> str | None:
    """`uri` as it may be shown (logs, errors, metadata, an HTTP answer such as serving's /v1/methods): its
    credentials (user:password@, or a lone token@) as ***@, and the value of any query parameter whose name looks
    like a secret's (?token=..., ?password=...) as ***. None stays None; text that is not a URI is returned as
    it is, with the credentials of anything shaped like scheme://userinfo@ in it still replaced."""
    if uri is None:
        return None
    try:
        parts = shown = urlsplit(uri)
    except ValueError:  # not a URI (an unbalanced "[" in its host): the credentials pattern below still applies
        parts = shown = None
    if parts is not None and parts.scheme and "@" in parts.netloc:
        shown = shown._replace(netloc=f"***@{parts.netloc.rpartition('@')[2]}")
    if parts is not None and parts.query:
        fields = [field.partition("=") for field in parts.query.split("&")]
        shown = shown._replace(query="&".join(
            f"{name}={'***' if re.search(SECRET_QUERY_PATTERN, name) else value}" if equals else name
            for name, equals, value in fields))
    text = uri if shown == parts else urlunsplit(shown)  # unchanged: as given (urlunsplit drops sqlite:////'s slashes)
    return re.sub(r"(?<=://)[^/?#\s@]+@", "***@", text)  # also a URI inside a longer text


def environment_secrets(environ: Mapping[str, str] | None = None, pattern: str = SECRET_ENV_PATTERN,
                        min_length: int = MIN_FOLDED_LENGTH) -> dict[str, str]:
    """The variables of `environ` (default os.environ) whose name looks like a secret's (`pattern`) and whose
    value has `min_length` characters or more: name -> value."""
    environ = os.environ if environ is None else environ
    return {name: value for name, value in environ.items() if re.search(pattern, name) and len(value) >= min_length}
