"""A disk cache of embeddings keyed by model and content hash (SQLite), so re-embedding a corpus is free.

Vectors are stored as float32 bytes. The cache is safe to delete; it only ever saves time.
"""

from __future__ import annotations

import hashlib
import sqlite3
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import numpy.typing as npt

from .embedder import Embedder


def text_hash(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


class EmbeddingCache:
    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        # One caller at a time, possibly from a worker thread (asyncio.to_thread).
        self._db = sqlite3.connect(path, check_same_thread=False)
        self._db.execute(
            "CREATE TABLE IF NOT EXISTS embeddings ("
            " model TEXT NOT NULL, content_hash TEXT NOT NULL, vector BLOB NOT NULL,"
            " PRIMARY KEY (model, content_hash))"
        )

    def close(self) -> None:
        self._db.close()

    def get_many(self, model: str, hashes: Sequence[str]) -> dict[str, npt.NDArray[np.float32]]:
        found: dict[str, npt.NDArray[np.float32]] = {}
        for start in range(0, len(hashes), 500):
            chunk = list(hashes[start : start + 500])
            marks = ",".join("?" * len(chunk))
            rows = self._db.execute(
                f"SELECT content_hash, vector FROM embeddings WHERE model = ? AND content_hash IN ({marks})",
                [model, *chunk],
            )
            for content_hash, blob in rows:
                found[content_hash] = np.frombuffer(blob, dtype=np.float32)
        return found

    def put_many(self, model: str, vectors: dict[str, npt.NDArray[np.float32]]) -> None:
        with self._db:
            self._db.executemany(
                "INSERT OR REPLACE INTO embeddings (model, content_hash, vector) VALUES (?, ?, ?)",
                [(model, h, np.asarray(v, dtype=np.float32).tobytes()) for h, v in vectors.items()],
            )

    def embed(
        self,
        embedder: Embedder,
        texts: Sequence[str],
        batch_size: int = 64,
        on_progress: Callable[[int], None] | None = None,
    ) -> npt.NDArray[np.float32]:
        """Embeddings of ``texts`` in order, computing (in batches) only the ones not cached yet."""
        hashes = [text_hash(t) for t in texts]
        known = self.get_many(embedder.cache_name, hashes)
        if on_progress is not None:
            on_progress(len(hashes) - len({h for h in hashes if h not in known}))
        first_of: dict[str, int] = {}
        for i, h in enumerate(hashes):
            if h not in known:
                first_of.setdefault(h, i)
        missing = list(first_of.values())
        for start in range(0, len(missing), batch_size * 8):
            indexes = missing[start : start + batch_size * 8]
            vectors = embedder.embed_documents([texts[i] for i in indexes], batch_size=batch_size)
            fresh = {hashes[i]: vectors[n] for n, i in enumerate(indexes)}
            self.put_many(embedder.cache_name, fresh)
            known.update(fresh)
            if on_progress is not None:
                on_progress(len(indexes))
        return np.stack([known[h] for h in hashes]) if hashes else np.zeros((0, embedder.dimension), np.float32)
