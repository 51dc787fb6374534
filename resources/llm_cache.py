"""The LLM resource's answer cache (resources/llm.py): every answer that parsed, in a SQLAlchemy table keyed by a
SHA-256 of (model, messages, sampling parameters), so that re-running an asset makes no request at all and a crash
half-way loses nothing that was already answered. Answers are stored as the resource hands them to its caller:
with the API key and URL credentials redacted; the key itself is never part of a row or of the cache key."""

from __future__ import annotations

import hashlib
import json
from datetime import datetime, timezone
from pathlib import Path

from sqlalchemy import (Column, DateTime, MetaData, String, Table, Text, create_engine, delete, insert, inspect,
                        select)
from sqlalchemy.engine import make_url
from sqlalchemy.exc import DatabaseError, IntegrityError

Messages = list[dict[str, str]]

_CACHE_METADATA = MetaData()
LLM_CACHE = Table(
    "llm_cache", _CACHE_METADATA,
    Column("key", String(64), primary_key=True, comment="SHA-256 of model, messages and sampling parameters"),
    Column("prompt_id", String(200), nullable=False),
    Column("model", String(200), nullable=False),
    Column("answer", Text, nullable=False, comment="the answer text (secrets redacted), which parsed when stored"),
    Column("created_at", DateTime(timezone=True), nullable=False),
)


class AnswerCache:
    """Answers that parsed, in any SQLAlchemy database (a SQLite file or a server); thread-safe: one engine,
    one short transaction per read or write."""

    def __init__(self, url: str):
        parsed = make_url(url)
        if parsed.get_backend_name() == "sqlite" and parsed.database and parsed.database != ":memory:":
            Path(parsed.database).parent.mkdir(parents=True, exist_ok=True)
        self.engine = create_engine(parsed)
        try:
            _CACHE_METADATA.create_all(self.engine)
        except DatabaseError:  # another process created the table between the check and the CREATE
            if not inspect(self.engine).has_table(LLM_CACHE.name):
                raise

    def get(self, key: str) -> str | None:
        with self.engine.connect() as connection:
            return connection.execute(select(LLM_CACHE.c.answer).where(LLM_CACHE.c.key == key)).scalar()

    def put(self, key: str, prompt_id: str, model: str, answer: str) -> None:
        row = {"key": key, "prompt_id": prompt_id, "model": model, "answer": answer,
               "created_at": datetime.now(timezone.utc)}
        try:
            with self.engine.begin() as connection:
                connection.execute(delete(LLM_CACHE).where(LLM_CACHE.c.key == key))
                connection.execute(insert(LLM_CACHE).values(**row))
        except IntegrityError:
            pass  # a concurrent call stored an answer to the identical request first; keep that one

    def close(self) -> None:
        self.engine.dispose()


def request_key(model: str, messages: Messages, temperature: float, max_tokens: int, seed: int | None) -> str:
    """SHA-256 (hex) of everything that determines an answer: the cache key."""
    material = {"model": model, "messages": messages, "temperature": temperature, "max_tokens": max_tokens,
                "seed": seed}
    return hashlib.sha256(json.dumps(material, sort_keys=True, ensure_ascii=False,
                                     separators=(",", ":")).encode("utf-8")).hexdigest()
