"""Late interaction (ColBERT's MaxSim) over token vectors stored one sign bit per dimension (pure functions).

The embedding model's forward pass already yields a vector per token; the ingester keeps their signs, packed, so
a query can compare its own tokens with a candidate's without running the model over the candidate again. A sign
bit costs 48 bytes a token at 384 dimensions (float32: 1,536). The query side stays float: the score is the
query token's cosine with the sign vector, which keeps the ordering of float32 MaxSim on the evaluation sets
(docs/quality.md has the measurements).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

TokenMatrix = npt.NDArray[np.float32]
"""One row per token."""


def bytes_per_token(dimension: int) -> int:
    return math.ceil(dimension / 8)


def pack_signs(tokens: TokenMatrix) -> bytes:
    """Each token's sign bits, row after row, in numpy ``packbits`` order (first dimension in the high bit)."""
    return np.packbits(np.asarray(tokens) > 0, axis=1).tobytes()


def token_count(data: bytes, dimension: int) -> int:
    """How many tokens packed sign bits hold; ValueError when the length is no whole number of tokens."""
    width = bytes_per_token(dimension)
    if not data or len(data) % width:
        raise ValueError(f"{len(data)} bytes are not a whole number of {dimension}-dimensional tokens ({width} bytes)")
    return len(data) // width


def unpack_signs(data: bytes, dimension: int) -> TokenMatrix:
    """Packed sign bits as unit rows of ±1/sqrt(dimension)."""
    rows = np.frombuffer(data, dtype=np.uint8).reshape(token_count(data, dimension), bytes_per_token(dimension))
    bits = np.unpackbits(rows, axis=1, count=dimension).astype(np.float32)
    unit: TokenMatrix = (bits * 2.0 - 1.0) / np.float32(math.sqrt(dimension))
    return unit


def max_similarities(query_tokens: TokenMatrix, documents: Sequence[TokenMatrix]) -> list[float]:
    """For each document, each query token's best cosine among the document's tokens, averaged (one unit row per
    token everywhere). One product in torch, not numpy: numpy's BLAS threads keep spinning for a while after a
    call, and took twice the time from the next query's embedding (docs/benchmarks.md)."""
    import torch  # here, not at the top: the CLI and the ingester import this module and need no torch to start

    if not documents:
        return []
    similarities = torch.from_numpy(query_tokens) @ torch.from_numpy(np.concatenate(documents)).T
    per_document = torch.split(similarities, [len(d) for d in documents], dim=1)
    return [float(s.max(dim=1).values.mean()) for s in per_document]


@functools.cache
def _byte_bits() -> Any:
    """The bits of each byte value as float rows (256 × 8, high bit first, as packbits orders them); a torch
    tensor, made on first use so that importing this module needs no torch."""
    import torch

    return torch.from_numpy(np.unpackbits(np.arange(256, dtype=np.uint8)[:, None], axis=1).astype(np.float32))


def max_similarities_of_signs(query_tokens: TokenMatrix, documents: Sequence[bytes], dimension: int) -> list[float]:
    """:func:`max_similarities` over documents' packed sign bits (:func:`pack_signs`), without making float rows
    of them: a sign row is (2·bits − 1)/√d, so its cosine with a query row is (2·(q·bits) − Σq)/√d, which rises
    with q·bits; each query token's best over a document is taken on q·bits, then turned into the cosine.

    q·bits is summed byte by byte from a table of what each of the 256 values of each byte adds to each query
    token (48 × 256 rows at 384 dimensions, made by one small product), one lookup per stored byte: 0.6 of the
    time of unpacking the bits into floats and multiplying (docs/benchmarks.md, "Late interaction by lookup"),
    which in turn took half the time of unpacking each document into float rows. ValueError when a document's
    bytes are not whole tokens of ``dimension``."""
    import torch  # here, not at the top: see max_similarities

    if not documents:
        return []
    counts = [token_count(data, dimension) for data in documents]
    width = bytes_per_token(dimension)
    stored = np.frombuffer(b"".join(documents), dtype=np.uint8).reshape(sum(counts), width)
    query = torch.from_numpy(np.ascontiguousarray(query_tokens, dtype=np.float32))
    # The bits past the dimension in a token's last byte are zero (packbits' padding): they meet zero weights.
    padded = torch.nn.functional.pad(query, (0, 8 * width - dimension))
    table = (_byte_bits() @ padded.T.reshape(width, 8, -1)).reshape(width * 256, -1)
    rows = torch.from_numpy(stored.astype(np.int64)) + torch.arange(0, width * 256, 256, dtype=torch.int64)
    offsets = torch.arange(0, rows.numel(), width, dtype=torch.int64)
    on_bits = torch.nn.functional.embedding_bag(rows.reshape(-1), table, offsets, mode="sum")  # a row per token
    best = torch.segment_reduce(on_bits, "max", lengths=torch.tensor(counts), axis=0)  # a row per document
    cosines = (2 * best - query.sum(dim=1)) / math.sqrt(dimension)
    return [float(value) for value in cosines.mean(dim=1)]


def z_scores(values: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
    """Values centred and scaled by their spread; all zero when they have none (equal values leave rounding noise,
    1e-17 rather than 0, which is no spread either)."""
    mean, spread = float(values.mean()), float(values.std())
    if spread <= 1e-9 * max(1.0, abs(mean)):
        return np.zeros(len(values), dtype=np.float64)
    centred: npt.NDArray[np.float64] = (values - mean) / spread
    return centred


def blend_with_fused_relevance(
    similarities: Sequence[float | None], relevances: Sequence[float], weight: float
) -> list[float]:
    """Relevances in (0, 1) for candidates given in fused order: the z-score of each one's fused relevance and the
    z-score of its similarity, mixed with ``weight`` on the similarity, through a sigmoid. On the fused relevances,
    not the fused positions: a candidate far ahead in the fusion (first in both lists, say) is not overtaken by
    one the fusion put near zero for its tokens alone, as it was when only positions counted (an independent
    tester's finding; nDCG@10 the same either way, docs/quality.md). A candidate without a similarity (no stored
    token vectors), and every candidate when the similarities have no spread, takes its fused z-score for one, so
    late interaction neither lifts nor sinks it. The mix orders; the sigmoid keeps the [0, 1] promise of a result's
    score. The result is relative to the candidates given, not a calibrated probability."""
    count = len(similarities)
    if count < 2:
        return [0.5] * count
    fused = z_scores(np.asarray(relevances, dtype=np.float64))
    similarity = fused.copy()
    known = [i for i, s in enumerate(similarities) if s is not None]
    measured = z_scores(np.asarray([similarities[i] for i in known], dtype=np.float64))
    if measured.any():  # similarities with no spread say nothing: those candidates keep their fused standing too
        similarity[known] = measured
    mixed = (1.0 - weight) * fused + weight * similarity
    return [float(v) for v in 1.0 / (1.0 + np.exp(-mixed))]
