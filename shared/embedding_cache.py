"""A disk cache of embeddings keyed by model and content hash (SQLite), so re-embedding a corpus is free.

Vectors are stored as float32 bytes, token vectors as their packed sign bits (shared/late_interaction.py). The
cache is safe to delete; it only ever saves time.
"""

from __future__ import annotations

import hashlib
import sqlite3
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt

from .embedder import Embedder
from .files import make_directory
from .late_interaction import pack_signs
from .settings import SettingsUnusable


def text_hash(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def longest_first(texts: Sequence[str]) -> list[int]:
    """The indexes of ``texts``, longest first: the order to embed many texts in. A batch pads each text to its
    longest; batches of texts of like length waste least (1.1x to 1.9x the texts a second of file order, by corpus:
    docs/benchmarks.md, "Ingest embedding"). Longest first, so that a progress bar's estimate of the time left errs
    long, not short."""
    return sorted(range(len(texts)), key=lambda i: -len(texts[i]))


@dataclass(frozen=True)
class Embedded:
    vectors: npt.NDArray[np.float32]
    """One L2-normalised row per text."""
    token_signs: list[bytes]
    """Per text, its token vectors' packed sign bits; empty when the model's tokens are not as wide as its vectors
    (a model with a projection after pooling), which late interaction cannot compare with a query's."""


def embed_with_signs(embedder: Embedder, texts: Sequence[str], batch_size: int = 64) -> Embedded:
    """One pass of the model over ``texts``: their vectors and their tokens' packed sign bits."""
    vectors, tokens = embedder.embed_with_tokens(texts, batch_size=batch_size)
    return Embedded(vectors, [pack_signs(t) if t.shape[1] == embedder.dimension else b"" for t in tokens])


class EmbeddingCache:
    def __init__(self, path: Path) -> None:
        try:
            make_directory(path.parent)
            # One caller at a time, possibly from a worker thread (asyncio.to_thread).
            self._db = sqlite3.connect(path, check_same_thread=False)
            self._create()
        except (OSError, sqlite3.Error) as error:  # an operator tester's cache directory that was a file: a traceback
            raise SettingsUnusable(
                f"ONTOFABRIC_CACHE_DIR: the embedding cache {path} cannot be opened ({error}): set it to a directory "
                "this user may write (a damaged cache file may be deleted: it is made again)"
            ) from error

    def _create(self) -> None:
        self._db.execute(
            "CREATE TABLE IF NOT EXISTS embeddings ("
            " model TEXT NOT NULL, content_hash TEXT NOT NULL, vector BLOB NOT NULL,"
            " PRIMARY KEY (model, content_hash))"
        )
        self._db.execute(
            "CREATE TABLE IF NOT EXISTS token_signs ("
            " model TEXT NOT NULL, content_hash TEXT NOT NULL, signs BLOB NOT NULL,"
            " PRIMARY KEY (model, content_hash))"
        )

    def close(self) -> None:
        self._db.close()

    def get_many(self, model: str, hashes: Sequence[str]) -> dict[str, tuple[npt.NDArray[np.float32], bytes]]:
        """The vector and token signs of each hash that has both."""
        found: dict[str, tuple[npt.NDArray[np.float32], bytes]] = {}
        for start in range(0, len(hashes), 500):
            chunk = list(hashes[start : start + 500])
            marks = ",".join("?" * len(chunk))
            rows = self._db.execute(
                "SELECT e.content_hash, e.vector, t.signs FROM embeddings e"
                " JOIN token_signs t USING (model, content_hash)"
                f" WHERE e.model = ? AND e.content_hash IN ({marks})",
                [model, *chunk],
            )
            for content_hash, vector, signs in rows:
                found[content_hash] = (np.frombuffer(vector, dtype=np.float32), signs)
        return found

    def put_many(self, model: str, entries: dict[str, tuple[npt.NDArray[np.float32], bytes]]) -> None:
        with self._db:
            self._db.executemany(
                "INSERT OR REPLACE INTO embeddings (model, content_hash, vector) VALUES (?, ?, ?)",
                [(model, h, np.asarray(v, dtype=np.float32).tobytes()) for h, (v, _) in entries.items()],
            )
            self._db.executemany(
                "INSERT OR REPLACE INTO token_signs (model, content_hash, signs) VALUES (?, ?, ?)",
                [(model, h, signs) for h, (_, signs) in entries.items()],
            )

    def vectors(
        self, model: str, compute: Callable[[Sequence[str]], npt.NDArray[np.float32]], texts: Sequence[str]
    ) -> npt.NDArray[np.float32]:
        """Vectors alone (no token signs) of ``texts`` in order, by ``model``, computing only those not cached."""
        hashes = [text_hash(t) for t in texts]
        known: dict[str, npt.NDArray[np.float32]] = {}
        for start in range(0, len(hashes), 500):
            chunk = list(dict.fromkeys(hashes[start : start + 500]))
            marks = ",".join("?" * len(chunk))
            rows = self._db.execute(
                f"SELECT content_hash, vector FROM embeddings WHERE model = ? AND content_hash IN ({marks})",
                [model, *chunk],
            )
            known.update((h, np.frombuffer(v, dtype=np.float32)) for h, v in rows)
        first_of = {h: i for i, h in reversed(list(enumerate(hashes))) if h not in known}
        if first_of:
            computed = compute([texts[i] for i in first_of.values()])
            fresh = dict(zip(first_of, computed, strict=True))
            with self._db:
                self._db.executemany(
                    "INSERT OR REPLACE INTO embeddings (model, content_hash, vector) VALUES (?, ?, ?)",
                    [(model, h, np.asarray(v, dtype=np.float32).tobytes()) for h, v in fresh.items()],
                )
            known.update(fresh)
        if not hashes:
            return np.zeros((0, 0), np.float32)
        return np.stack([known[h] for h in hashes])

    def embed(
        self,
        embedder: Embedder,
        texts: Sequence[str],
        batch_size: int = 64,
        on_progress: Callable[[int], None] | None = None,
    ) -> Embedded:
        """Embeddings of ``texts`` in order, computing (in batches) only the ones not cached yet."""
        hashes = [text_hash(t) for t in texts]
        known = self.get_many(embedder.cache_name, hashes)
        if on_progress is not None:
            on_progress(len(hashes) - len({h for h in hashes if h not in known}))
        first_of: dict[str, int] = {}
        for i in longest_first(texts):
            if hashes[i] not in known:
                first_of.setdefault(hashes[i], i)
        missing = list(first_of.values())
        for start in range(0, len(missing), batch_size * 8):
            indexes = missing[start : start + batch_size * 8]
            computed = embed_with_signs(embedder, [texts[i] for i in indexes], batch_size)
            fresh = {hashes[i]: (computed.vectors[n], computed.token_signs[n]) for n, i in enumerate(indexes)}
            self.put_many(embedder.cache_name, fresh)
            known.update(fresh)
            if on_progress is not None:
                on_progress(len(indexes))
        if not hashes:
            return Embedded(np.zeros((0, embedder.dimension), np.float32), [])
        return Embedded(np.stack([known[h][0] for h in hashes]), [known[h][1] for h in hashes])
