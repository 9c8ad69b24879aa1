"""The Embedder port and its local adapter (sentence-transformers on CPU, offline).

A model reads a bounded number of tokens (all-MiniLM-L6-v2: 256) and silently drops the rest, so a text longer
than that is embedded in consecutive windows and their vectors pooled (:func:`pool_windows`).

Embedding is CPU-bound: callers in an event loop use :meth:`Embedder.embed_query_with_tokens_async`, which runs the
model on one dedicated thread so concurrent requests queue instead of fighting over the cores; the queries that
queued while the model was busy are then embedded together, in one batch (:class:`Coalescer`). Other CPU-bound
work of a query (late interaction) queues on the same thread through :meth:`Embedder.on_model_thread`, each
workspace's in its turn (:class:`ModelThread`).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import os
import re
import threading
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

import numpy as np
import numpy.typing as npt

from .late_interaction import TokenMatrix
from .logging import get_logger
from .lru import LruCache
from .settings import Precision, QueryRuntime, Settings
from .turns import Turns

if TYPE_CHECKING:
    from sentence_transformers import SentenceTransformer

    from .http_embedder import HttpEmbedder
    from .onnx_models import OnnxSentenceEncoder

log = get_logger(__name__)

Vector = npt.NDArray[np.float32]
T = TypeVar("T")
In = TypeVar("In")
Out = TypeVar("Out")

# Queries embedded in one forward pass at most. On 2 CPU cores a cosqa query cost 7.6 ms alone, 3.2 ms in a batch
# of 4 and 2.5 ms in a batch of 16 (docs/benchmarks.md, "Query load").
MAX_QUERY_BATCH = 32
MAX_QUERY_BATCH_CHARS = 4096
"""Characters of queries one batch embeds at most (one longer query goes alone): a batch holds the model thread,
and 12 queries of 2,000 characters each, read in windows, held it for 2 s while another tenant's query waited."""
WORKSPACES_BATCHED = 4096
"""Workspaces whose query batching a model keeps (the least recently asked go first)."""


class EmbedderMismatch(Exception):
    """The model does not fit the deployment's settings: vectors of another dimension, or no fast tokenizer where
    long texts are to be read in windows."""


class Embedder(Protocol):
    @property
    def model_name(self) -> str: ...

    @property
    def cache_name(self) -> str:
        """What the embedding cache keys vectors by: the model, and its arithmetic where that changes the vectors."""
        ...

    @property
    def vectors_name(self) -> str:
        """What the vectors are, for telling whether stored ones must be made again: the model and how it reads a
        long text, not its arithmetic (bfloat16's vectors are float32's to a cosine of 0.9999), so that ingesters
        on CPUs with and without native bfloat16 send nothing again for it."""
        ...

    @property
    def dimension(self) -> int: ...

    def embed_documents(self, texts: Sequence[str], batch_size: int = 64) -> npt.NDArray[np.float32]:
        """One L2-normalised row per text."""
        ...

    def embed_with_tokens(
        self, texts: Sequence[str], batch_size: int = 64
    ) -> tuple[npt.NDArray[np.float32], list[TokenMatrix]]:
        """One pass of the model: the L2-normalised row of each text, and its tokens' vectors (unit rows, one per
        token the model read in the text's first window, for late interaction)."""
        ...

    def embed_query(self, text: str) -> Vector: ...

    async def embed_query_with_tokens_async(self, text: str, turn: str = "") -> tuple[Vector, TokenMatrix]:
        """The query's vector and token vectors, embedded on the model thread in ``turn``'s turn (a workspace),
        batched with that turn's queries that queued meanwhile."""
        ...

    async def on_model_thread(self, work: Callable[[], T], turn: str = "") -> T:
        """``work`` run on the thread the model runs on, in ``turn``'s turn (a workspace): behind that turn's jobs
        asked before it, and after one of every other turn's."""
        ...


def cpu_has_bfloat16(cpuinfo: Path = Path("/proc/cpuinfo")) -> bool:
    """Whether this CPU has native bfloat16 arithmetic (AVX-512 BF16 or AMX); Linux only, False elsewhere. Where
    it is emulated, bfloat16 is slower than float32."""
    try:
        flags = cpuinfo.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return False
    return re.search(r"\b(avx512_bf16|amx_bf16)\b", flags) is not None


def unit_rows(matrix: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]:
    """Each row scaled to length one (an all-zero row stays zero)."""
    scaled: npt.NDArray[np.float32] = matrix / np.maximum(np.linalg.norm(matrix, axis=1, keepdims=True), 1e-12)
    return scaled


def check_dimension(dimension: int, expected: int, model_name: str, model_path: Path) -> None:
    """Refuses a model whose vectors are not of the dimension the deployment is set to."""
    if dimension != expected:
        raise EmbedderMismatch(
            f"{model_name} at {model_path} makes {dimension}-dimensional vectors; "
            f"the deployment is set to {expected} (ONTOFABRIC_EMBEDDING_DIM)"
        )


def window_spans(
    offsets: Sequence[tuple[int, int]], word_ids: Sequence[int | None], width: int, limit: int
) -> list[tuple[int, int]]:
    """Character spans of the consecutive windows a tokenised text is read in, at most ``limit`` of them from the
    start: each at most ``width`` tokens and ending where a word ends, so its text tokenises as it did in the whole
    (a word longer than a window is cut). ``offsets`` and ``word_ids`` are the tokenizer's, one per token."""
    spans: list[tuple[int, int]] = []
    start = 0
    while start < len(offsets) and len(spans) < limit:
        end = min(start + width, len(offsets))
        if end < len(offsets):
            boundary = end  # the first token of the next window: move it back to the start of its word
            while boundary > start + 1 and word_ids[boundary] == word_ids[boundary - 1]:
                boundary -= 1
            if word_ids[boundary] != word_ids[boundary - 1]:
                end = boundary
        spans.append((offsets[start][0], offsets[end - 1][1]))
        start = end
    return spans


def pool_windows(vectors: npt.NDArray[np.float32], token_counts: Sequence[int]) -> Vector:
    """One text's unit vector from its windows' unit vectors (in text order): the first window's plus the mean of
    all, each weighted by the tokens the model read in it. The opening of a document (its title, signature or
    summary) says most about it, so it counts twice; the rest adds what the opening does not say. Against the
    first window alone (what sentence-transformers reads), a plain mean or the best window, this ranked best on
    long documents: docs/quality.md, "Long documents"."""
    if len(vectors) == 1:
        single: Vector = vectors[0]
        return single
    weights = np.asarray(token_counts, dtype=np.float32)
    mean = (vectors * weights[:, None]).sum(axis=0) / weights.sum()
    pooled: Vector = unit_rows((vectors[0] + mean)[None, :])[0]
    return pooled


def pieces_in_windows(
    texts: Sequence[str],
    tokenized: Sequence[tuple[Sequence[tuple[int, int]], Sequence[int | None]]],
    width: int,
    windows: int,
) -> tuple[list[str], list[int]]:
    """The pieces a model reads of ``texts`` (a text that fits in ``width`` tokens is one piece, as it is; a longer
    one its :func:`window_spans`), and the text each piece belongs to. ``tokenized``: each text's token offsets and
    word ids, without special tokens."""
    pieces: list[str] = []
    owners: list[int] = []
    for index, (text, (offsets, word_ids)) in enumerate(zip(texts, tokenized, strict=True)):
        spans = [(0, len(text))]
        if len(offsets) > width:
            spans = window_spans(offsets, word_ids, width, windows)
        pieces.extend(text[start:end] for start, end in spans)
        owners.extend([index] * len(spans))
    return pieces, owners


def pool_pieces(
    piece_vectors: npt.NDArray[np.float32], piece_tokens: Sequence[TokenMatrix], owners: Sequence[int]
) -> tuple[npt.NDArray[np.float32], list[TokenMatrix]]:
    """Each text's vector and token rows from those of its pieces (:func:`pieces_in_windows`), in text order."""
    windows_of: dict[int, list[int]] = {}
    for piece, owner in enumerate(owners):
        windows_of.setdefault(owner, []).append(piece)
    vectors, tokens = [], []
    for read in windows_of.values():
        vectors.append(pool_windows(piece_vectors[read], [len(piece_tokens[i]) for i in read]))
        # Late interaction compares the first window's tokens: those of every window ranked no better
        # (docs/quality.md, "Long documents") and would take up to four times the space.
        tokens.append(piece_tokens[read[0]])
    return np.stack(vectors), tokens


def wants_bfloat16(precision: Precision) -> bool:
    """A precision setting (`auto`, `float32`, `bfloat16`) resolved on this CPU."""
    return precision == "bfloat16" or (precision == "auto" and cpu_has_bfloat16())


class ModelMissing(Exception):
    """No model where a setting points: said in a line, not as the Hub client's traceback about repo ids."""


def load_sentence_transformer(model_path: Path, bfloat16: bool) -> SentenceTransformer:
    """A sentence-transformers model from a local directory, on CPU, never touching the network."""
    if not any((model_path / name).is_file() for name in ("config.json", "modules.json")):
        raise ModelMissing(
            f"no embedding model at {model_path} (no config.json or modules.json there): "
            "ONTOFABRIC_EMBEDDING_MODEL_PATH, and "
            "ONTOFABRIC_NEXT_EMBEDDING_MODEL_PATH during a model change, name a sentence-transformers model's directory"
        )
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    import torch
    from sentence_transformers import SentenceTransformer

    dtype = torch.bfloat16 if bfloat16 else torch.float32
    return SentenceTransformer(str(model_path), device="cpu", local_files_only=True, model_kwargs={"dtype": dtype})


class Coalescer(Generic[In, Out]):
    """Runs ``work`` over the items that callers submit, in batches: whatever queued while the previous batch ran.

    One caller alone waits for no one: its batch starts at once. Under load, callers that arrive while a batch runs
    go together into the next, so a model that costs less per item in a batch serves more callers. A batch that
    fails is run again item by item, so only a failing item fails its caller; a caller that gave up is left out.
    State belongs to one event loop; a caller from another loop gets a fresh one.
    """

    def __init__(
        self,
        work: Callable[[list[In]], Sequence[Out]],
        run: Callable[[Callable[[], Sequence[Out]]], Awaitable[Sequence[Out]]],
        max_batch: int,
        weight: Callable[[In], int] | None = None,
        max_weight: int | None = None,
    ) -> None:
        """``weight``, ``max_weight``: a batch weighs at most this much (one item may weigh more alone)."""
        self._work = work
        self._run = run
        self._max_batch = max_batch
        self._weight = weight
        self._max_weight = max_weight
        self._waiting: list[tuple[In, asyncio.Future[Out]]] = []
        self._drain: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    async def submit(self, item: In) -> Out:
        loop = asyncio.get_running_loop()
        if loop is not self._loop:  # a new loop (tests run one per test): nothing of the old one can be served
            self._loop, self._waiting, self._drain = loop, [], None
        future: asyncio.Future[Out] = loop.create_future()
        self._waiting.append((item, future))
        if self._drain is None or self._drain.done():
            self._drain = loop.create_task(self._run_batches(self._waiting))
        return await future

    async def _run_batches(self, waiting: list[tuple[In, asyncio.Future[Out]]]) -> None:
        try:
            while waiting:
                taken = self._batch_size(waiting)
                batch = [(item, future) for item, future in waiting[:taken] if not future.done()]
                del waiting[:taken]  # a caller that gave up (cancelled) costs the model nothing
                if batch:
                    await self._serve(batch)
        except BaseException:  # cancelled, as when the loop closes: no caller may wait for ever
            for _, future in waiting:
                future.cancel()
            raise

    def _batch_size(self, waiting: list[tuple[In, asyncio.Future[Out]]]) -> int:
        """How many of the first waiting go in the next batch: up to ``max_batch``, and ``max_weight``."""
        if self._weight is None or self._max_weight is None:
            return self._max_batch
        size, weighed = 0, 0
        for item, _ in waiting[: self._max_batch]:
            weighed += self._weight(item)
            if size and weighed > self._max_weight:
                break
            size += 1
        return size

    async def _serve(self, batch: list[tuple[In, asyncio.Future[Out]]]) -> None:
        try:
            outputs = await self._run(partial(self._work, [item for item, _ in batch]))
            if len(outputs) != len(batch):
                raise RuntimeError(f"{len(outputs)} results for a batch of {len(batch)}")
        except Exception as error:
            if len(batch) > 1:
                for one in batch:  # one bad item must not fail the callers it happened to be batched with
                    await self._serve([one])
            elif not batch[0][1].done():
                batch[0][1].set_exception(error)
            return
        except BaseException:
            for _, future in batch:
                future.cancel()
            raise
        for (_, future), output in zip(batch, outputs, strict=True):
            if not future.done():
                future.set_result(output)


_Job = tuple[Callable[[], Any], "asyncio.Future[Any]", asyncio.AbstractEventLoop]
"""Work for the model thread, the future its caller waits on, and that caller's loop."""


class ModelThread:
    """The one thread a model runs on, its jobs taken in turn by key (the workspace a request serves), as the query
    worker takes its requests: one tenant's many jobs wait behind each other, not in front of another tenant's. A
    red team kept 16 costly requests of one workspace in flight (late interaction over 1,000 candidates each): the
    thread's first-come queue held another tenant's cheap query embedding for 2.4 s behind them.

    The thread takes its next job itself, under a lock: handed over by the event loop, one at a time, it waited for
    the loop between two jobs (10 % fewer answers a second at 16 in flight). A job whose caller gave up before the
    thread got to it is not run (a batch of query embeddings is the batching task's job: it runs unless that task
    gave up).
    """

    def __init__(self, executor: ThreadPoolExecutor) -> None:
        self._executor = executor
        self._lock = threading.Lock()
        self._jobs: Turns[_Job] = Turns()
        self._draining = False
        """Whether the thread is taking jobs (it stops when none is left, and is started again by the next)."""

    async def run(self, work: Callable[[], T], turn: str = "") -> T:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()
        with self._lock:
            self._jobs.put(turn, (work, future, loop))
            start, self._draining = not self._draining, True
        if start:
            try:
                self._executor.submit(self._drain)
            except RuntimeError:  # the executor is shut down: the next caller must not count on a drain
                with self._lock:
                    self._draining = False
                raise
        return await future

    def _next(self) -> _Job | None:
        with self._lock:
            job = self._jobs.take()
            self._draining = job is not None
            return job

    def _drain(self) -> None:
        """On the model thread: every job in turn, until none is left."""
        try:
            while (job := self._next()) is not None:
                work, future, loop = job
                if future.done():  # its caller gave up: the thread is spared the work
                    continue
                try:
                    result = work()
                except BaseException as error:  # the caller's to see, as it would from run_in_executor
                    _answer(loop, future, error=error)
                else:
                    _answer(loop, future, result=result)
        except BaseException:  # a bug here: the next job must start the thread again, not wait for ever
            log.exception("model_thread_failed")
            with self._lock:
                self._draining = False
            raise


def _answer(
    loop: asyncio.AbstractEventLoop, future: asyncio.Future[Any], result: Any = None, error: BaseException | None = None
) -> None:
    def settle() -> None:
        if future.done():
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)

    with contextlib.suppress(RuntimeError):  # the caller's loop is closed: there is no one to answer
        loop.call_soon_threadsafe(settle)


def use_threads_on(executor: ThreadPoolExecutor, threads: int) -> None:
    """The one thread of ``executor`` computes with ``threads`` CPU threads; every other thread keeps its count.

    PyTorch's count is the calling thread's (OpenMP's), but a thread's first use of torch takes the count last
    set anywhere: so the model thread is set up first, then this thread's count is set again, to what it was. (A
    thread whose first use of torch falls between the two, microseconds apart, would keep ``threads``.)"""
    import torch  # here: the CLI and the ingester import this module and need no torch to start

    own = torch.get_num_threads()

    def set_up() -> None:
        torch.get_num_threads()  # the thread's first use of torch, which would later reset what is set here
        torch.set_num_threads(threads)

    executor.submit(set_up).result()
    torch.set_num_threads(own)


class LocalSentenceTransformer:
    """A sentence-transformers model from a local directory; never touches the network.

    A text longer than the model reads is embedded in up to ``windows`` consecutive windows of its
    ``max_seq_length`` (1: only the first, as sentence-transformers does), pooled into one vector; its token
    vectors are those of the first window.

    Queries are embedded in float32. Documents are too, unless ``bfloat16``: then by a bfloat16 copy of the model,
    made from its weights when the first document is embedded (a query worker never makes it). Its vectors are
    float32's to a cosine of 0.9999 and come about twice as fast where the CPU computes bfloat16 natively
    (docs/benchmarks.md, "Ingest embedding")."""

    def __init__(
        self,
        model_name: str,
        model_path: Path,
        expected_dimension: int,
        *,
        bfloat16: bool = False,
        windows: int,
        query_threads: int | None = None,
        query_runtime: QueryRuntime = "torch",
        cache_dir: Path | None = None,
    ) -> None:
        """``query_runtime``: what embeds queries; ``onnx``: the model's export in ``cache_dir``, which PyTorch
        makes and checks on first use (:func:`~.onnx_models.query_encoder`). Once it has, a process finds the export
        checked (:func:`~.onnx_models.exported_encoder`) and loads PyTorch only when it embeds a document: a query
        worker then starts without PyTorch, the model on it, and their memory."""
        if windows < 1:
            raise ValueError("windows must be at least 1")
        self.model_name = model_name
        self.cache_name, self.vectors_name = embedder_names(model_name, bfloat16, windows)
        self.dimension = expected_dimension
        self._model_path = model_path
        self._windows = windows
        self._bfloat16 = bfloat16
        self._pytorch: SentenceTransformer | None = None
        self._pytorch_lock = threading.Lock()
        self._documents_model: SentenceTransformer | None = None
        self._documents_model_lock = threading.Lock()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="embedder")
        if query_threads is not None:
            # Late interaction computes with PyTorch on the model thread, whichever runtime embeds the queries.
            use_threads_on(self._executor, query_threads)
        self._thread = ModelThread(self._executor)
        # Batched by workspace, each batch in its workspace's turn on the thread: batched together, one tenant's
        # long queries made every batch as slow as theirs.
        self._queries: LruCache[str, Coalescer[str, tuple[Vector, TokenMatrix]]] = LruCache(WORKSPACES_BATCHED)
        self._onnx: OnnxSentenceEncoder | None = None
        if query_runtime == "onnx" and cache_dir is not None:
            from .onnx_models import exported_encoder

            self._onnx = exported_encoder(model_path, windows, query_threads or 0, cache_dir)
            if self._onnx is not None:
                check_dimension(self._onnx.dimension, expected_dimension, model_name, model_path)
        if self._onnx is None:
            model = self._model  # loaded and checked here, at start
            if query_runtime == "onnx":
                from .onnx_models import query_encoder

                self._onnx = query_encoder(
                    model[0].auto_model,
                    model_path,
                    model.max_seq_length,
                    query_threads or 0,
                    windows,
                    cache_dir,
                    self._embed_queries_on_torch,
                )
        self.query_runtime: QueryRuntime = "onnx" if self._onnx is not None else "torch"
        log.info(
            "embedder_loaded",
            model=model_name,
            path=str(model_path),
            dimension=expected_dimension,
            documents_bfloat16=bfloat16,
            query_runtime=self.query_runtime,
            pytorch_loaded=self._pytorch is not None,
        )

    @property
    def _model(self) -> SentenceTransformer:
        """The model on PyTorch, float32, loaded and checked when first needed."""
        with self._pytorch_lock:
            if self._pytorch is None:
                model = load_sentence_transformer(self._model_path, bfloat16=False)
                check_dimension(model.get_embedding_dimension(), self.dimension, self.model_name, self._model_path)
                if self._windows > 1 and not getattr(model.tokenizer, "is_fast", False):
                    # Windows are cut at the tokenizer's character offsets, which only a fast tokenizer reports.
                    raise EmbedderMismatch(
                        f"{self.model_name} at {self._model_path} has no fast tokenizer, which reading long texts "
                        "in windows needs; set ONTOFABRIC_EMBEDDING_WINDOWS=1"
                    )
                self._pytorch = model
            return self._pytorch

    def embed_documents(self, texts: Sequence[str], batch_size: int = 64) -> npt.NDArray[np.float32]:
        return self.embed_with_tokens(texts, batch_size)[0]

    def embed_with_tokens(
        self, texts: Sequence[str], batch_size: int = 64
    ) -> tuple[npt.NDArray[np.float32], list[TokenMatrix]]:
        return self._encode(self._for_documents(), texts, batch_size)

    def _for_documents(self) -> SentenceTransformer:
        model = self._model
        with self._documents_model_lock:
            if self._documents_model is None:
                if self._bfloat16:  # the weights checked at load, not read again from disk
                    import torch

                    self._documents_model = copy.deepcopy(model).to(torch.bfloat16)
                else:
                    self._documents_model = model
            return self._documents_model

    def _encode(
        self, model: SentenceTransformer, texts: Sequence[str], batch_size: int = 64
    ) -> tuple[npt.NDArray[np.float32], list[TokenMatrix]]:
        if not texts:
            return np.zeros((0, self.dimension), np.float32), []
        pieces, owners = self._read_in_windows(texts)
        # No progress bar: sentence-transformers draws one when its logger is at INFO or DEBUG, into the JSON log.
        encoded = model.encode(pieces, batch_size=batch_size, output_value=None, show_progress_bar=False)
        # Normalised here, in float32: normalised in bfloat16, lengths come out up to 0.2 % off one.
        window_vectors = unit_rows(np.stack([np.asarray(e["sentence_embedding"].float(), np.float32) for e in encoded]))
        # Batched rows are padded to the longest text: keep the tokens the attention mask says are real.
        window_tokens = [
            unit_rows(np.asarray(e["token_embeddings"][: int(e["attention_mask"].sum())].float(), np.float32))
            for e in encoded
        ]  # .float(): bfloat16 has no numpy dtype
        return pool_pieces(window_vectors, window_tokens, owners)

    def _read_in_windows(self, texts: Sequence[str]) -> tuple[list[str], list[int]]:
        """The pieces the model reads (a text that fits is one piece, as it is), and the text each belongs to."""
        if self._windows == 1:
            return list(texts), list(range(len(texts)))
        tokenizer = self._model.tokenizer
        width = self._model.max_seq_length - tokenizer.num_special_tokens_to_add(pair=False)
        tokenized = tokenizer(list(texts), add_special_tokens=False, return_offsets_mapping=True, verbose=False)
        read = [(tokenized["offset_mapping"][i], tokenized.word_ids(i)) for i in range(len(texts))]
        return pieces_in_windows(texts, read, width, self._windows)

    def embed_query(self, text: str) -> Vector:
        return self._embed_queries([text])[0][0]

    def _embed_queries(self, texts: list[str]) -> list[tuple[Vector, TokenMatrix]]:
        if self._onnx is None:
            return self._embed_queries_on_torch(texts)
        return self._onnx.embed(texts)

    def _embed_queries_on_torch(self, texts: list[str]) -> list[tuple[Vector, TokenMatrix]]:
        vectors, tokens = self._encode(self._model, texts)
        return list(zip(vectors, tokens, strict=True))

    async def embed_query_with_tokens_async(self, text: str, turn: str = "") -> tuple[Vector, TokenMatrix]:
        queries = self._queries.get(turn)
        if queries is None:
            queries = Coalescer(
                self._embed_queries, partial(self._thread.run, turn=turn), MAX_QUERY_BATCH, len, MAX_QUERY_BATCH_CHARS
            )
            self._queries.put(turn, queries)
        return await queries.submit(text)

    async def on_model_thread(self, work: Callable[[], T], turn: str = "") -> T:
        return await self._thread.run(work, turn)


def embedding_text(content: str, symbol_fqn: str | None) -> str:
    """The text a document's vector is made from: its symbol's qualified name (what code search asks by), then
    its content. Ingesters, and whatever embeds a stored document again for another model, read the same text."""
    return f"{symbol_fqn}\n{content}" if symbol_fqn else content


def embedder_names(model_name: str, bfloat16: bool, windows: int) -> tuple[str, str]:
    """An embedder's ``cache_name`` and ``vectors_name``. Vectors that differ are cached apart, so no setting is
    served another's: bfloat16 vectors are near float32's but not equal, and a long text read in windows differs
    from its first window alone."""
    read = f"+windows{windows}" if windows > 1 else ""
    return model_name + ("@bfloat16" if bfloat16 else "") + read, model_name + read


class DocumentEncoder(Protocol):
    """What embeds an ingest's documents: the model on PyTorch, or its export on ONNX Runtime."""

    def embed_with_tokens(
        self, texts: Sequence[str], batch_size: int = 64
    ) -> tuple[npt.NDArray[np.float32], list[TokenMatrix]]: ...


class LoadedOnDemand:
    """The deployment's local model, loaded when it first embeds (``for_queries`` False, as an ingest loads it):
    an ingest with nothing to embed, or whose texts the embedding cache holds (a branch checked out again, an
    edit undone), does not wait the seconds the model takes to load. Its names, known before, are the model's
    (:func:`embedder_names`). It is an :class:`Embedder`.

    Documents in float32 are embedded by the model's ONNX export when one in ``cache_dir`` was checked against
    PyTorch (``document_embedding_runtime``, :func:`~.onnx_models.exported_encoder`): PyTorch and the model then
    never load, which took an ingest of an edit 5 to 7 of its seconds. Otherwise the model loads on PyTorch; the
    export is made by the first query worker (``ontofabric up``) or image build that loads the model."""

    def __init__(self, settings: Settings) -> None:
        self._settings = settings
        self.model_name = settings.embedding_model
        bfloat16 = wants_bfloat16(settings.embedding_precision)
        self.cache_name, self.vectors_name = embedder_names(self.model_name, bfloat16, settings.embedding_windows)
        self.dimension = settings.embedding_dim
        self._model: LocalSentenceTransformer | None = None
        self._exported: DocumentEncoder | None = None
        self._export_looked_for = False
        self._lock = threading.Lock()

    @property
    def loaded(self) -> bool:
        """Whether a model is loaded: on PyTorch (:meth:`model`) or as its export."""
        return self._model is not None or self._exported is not None

    @property
    def on_onnx(self) -> bool:
        """Whether documents are embedded by the export, without PyTorch."""
        return self._exported is not None

    def model(self) -> LocalSentenceTransformer:
        with self._lock:
            if self._model is None:
                # Without an ONNX session: where no export agrees with the model, every ingest would make one again.
                self._model = load_embedder(self._settings, for_queries=False)
            return self._model

    def _for_documents(self) -> DocumentEncoder:
        with self._lock:
            if not self._export_looked_for and self._model is None:
                self._export_looked_for = True
                self._exported = self._export()
            if self._exported is not None:
                return self._exported
        return self.model()

    def _export(self) -> DocumentEncoder | None:
        settings = self._settings
        if settings.document_embedding_runtime != "onnx" or wants_bfloat16(settings.embedding_precision):
            return None
        if settings.cache_dir is None:
            return None
        from .onnx_models import exported_encoder

        model_path = settings.resolved_model_path()
        encoder = exported_encoder(model_path, settings.embedding_windows, 0, settings.cache_dir)
        if encoder is None:
            # Said, as the export's own warnings (if any) are about the export, not about what embeds instead.
            log.info("documents_on_pytorch", reason="no export checked against PyTorch for these settings")
            return None
        check_dimension(encoder.dimension, settings.embedding_dim, settings.embedding_model, model_path)
        log.info("embedder_loaded", model=settings.embedding_model, dimension=encoder.dimension, documents="onnx")
        return encoder

    def embed_documents(self, texts: Sequence[str], batch_size: int = 64) -> npt.NDArray[np.float32]:
        return self.embed_with_tokens(texts, batch_size)[0]

    def embed_with_tokens(
        self, texts: Sequence[str], batch_size: int = 64
    ) -> tuple[npt.NDArray[np.float32], list[TokenMatrix]]:
        return self._for_documents().embed_with_tokens(texts, batch_size)

    def embed_query(self, text: str) -> Vector:
        return self.model().embed_query(text)

    def embed_query_with_tokens_async(
        self, text: str, turn: str = ""
    ) -> Coroutine[Any, Any, tuple[Vector, TokenMatrix]]:
        return self.model().embed_query_with_tokens_async(text, turn)

    def on_model_thread(self, work: Callable[[], T], turn: str = "") -> Coroutine[Any, Any, T]:
        return self.model().on_model_thread(work, turn)


def load_embedder(settings: Settings, for_queries: bool = True) -> LocalSentenceTransformer:
    """The local model ``settings`` name (its current embedding model). ``for_queries`` False: a process that only
    embeds documents, which runs no ONNX Runtime session for queries (``query_embedding_runtime``)."""
    return LocalSentenceTransformer(
        settings.embedding_model,
        settings.resolved_model_path(),
        settings.embedding_dim,
        bfloat16=wants_bfloat16(settings.embedding_precision),
        windows=settings.embedding_windows,
        query_threads=settings.query_model_threads,
        query_runtime=settings.query_embedding_runtime if for_queries else "torch",
        cache_dir=settings.cache_dir,
    )


class ServedModel:
    """The embedder of whichever model the index holds, for a process that may see the model change
    (``ontofabric reembed``): every model ``settings.models()`` names is loaded up front, so the switch, when the
    process sees the index hold another model (:meth:`observe`), costs nothing. It is an :class:`Embedder`."""

    def __init__(self, settings: Settings, for_queries: bool = True) -> None:
        self._models = {name: load_embedder(model, for_queries) for name, model in settings.models().items()}
        self._active = self._models[settings.embedding_model]
        self._unknown: set[str] = set()

    @property
    def model_name(self) -> str:
        return self._active.model_name

    @property
    def cache_name(self) -> str:
        return self._active.cache_name

    @property
    def vectors_name(self) -> str:
        return self._active.vectors_name

    @property
    def dimension(self) -> int:
        return self._active.dimension

    def observe(self, model: str) -> None:
        """The index holds ``model``'s vectors now: embed by it from here on, if this process has it (else it goes
        on with its own, and reads of that index run without dense search)."""
        if model == self._active.model_name:
            return
        embedder = self._models.get(model)
        if embedder is None:
            if model not in self._unknown:
                self._unknown.add(model)
                log.error("embedding_model_unknown", index_model=model, models=sorted(self._models))
            return
        log.info("embedding_model_switched", previous=self._active.model_name, model=model)
        self._active = embedder

    def embed_documents(self, texts: Sequence[str], batch_size: int = 64) -> npt.NDArray[np.float32]:
        return self._active.embed_documents(texts, batch_size)

    def embed_with_tokens(
        self, texts: Sequence[str], batch_size: int = 64
    ) -> tuple[npt.NDArray[np.float32], list[TokenMatrix]]:
        return self._active.embed_with_tokens(texts, batch_size)

    def embed_query(self, text: str) -> Vector:
        return self._active.embed_query(text)

    def embed_query_with_tokens_async(
        self, text: str, turn: str = ""
    ) -> Coroutine[Any, Any, tuple[Vector, TokenMatrix]]:
        # Not async itself: the model is chosen when it is called, with its name read alongside, not later.
        return self._active.embed_query_with_tokens_async(text, turn)

    def on_model_thread(self, work: Callable[[], T], turn: str = "") -> Coroutine[Any, Any, T]:
        return self._active.on_model_thread(work, turn)

    def embedder_of(self, model: str) -> Embedder | None:
        """The loaded embedder of ``model``, if this process has it."""
        return self._models.get(model)


def build_embedder(settings: Settings, for_queries: bool = True, on_demand: bool = False) -> Embedder | None:
    """The deployment's embedder, or None when it is set to ``none`` (keyword-only answers). While a model change
    is set (``next_embedding_model``), one that serves either model: :class:`ServedModel`. ``on_demand`` (with
    ``for_queries`` False): loaded when it first embeds (:class:`LoadedOnDemand`), but for a model change."""
    if settings.embedder == "none":
        return None
    if settings.embedder == "openai":
        return http_embedder(settings)
    if settings.next_model() is not None:
        return ServedModel(settings, for_queries)
    if on_demand and not for_queries:
        return LoadedOnDemand(settings)
    return load_embedder(settings, for_queries)


def http_embedder(settings: Settings) -> HttpEmbedder:
    """The OpenAI-compatible embeddings API ``settings`` name (``embedder=openai``), its dimension checked."""
    from .http_embedder import HttpEmbedder

    assert settings.embedding_api_url is not None  # the settings' own check
    embedder = HttpEmbedder(
        settings.embedding_api_url,
        settings.embedding_model,
        settings.embedding_dim,
        settings.embedding_api_key.get_secret_value() if settings.embedding_api_key else None,
        batch_size=settings.embedding_api_batch,
        max_characters=settings.embedding_api_max_characters,
        timeout_s=settings.embedding_api_timeout_ms / 1000,
        send_dimensions=settings.embedding_api_dimensions,
    )
    embedder.check()
    return embedder
