"""The reference ingester: chunk a source tree, publish only what changed since the last ingest.

The last ingest of each (workspace, branch) is remembered as a manifest (document id -> content hash) in a
JetStream object store, so any machine can ingest incrementally. Manifests are written only after every delta
is stored; an interrupted run publishes the same event ids again, which the projector applies once.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import gc
import hashlib
import json
import os
import threading
import time
from collections import Counter
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import numpy.typing as npt
from nats.js import JetStreamContext
from nats.js.api import PubAck

from ontofabric.contracts import (
    MAIN_BRANCH,
    DeltaEnvelope,
    DeltaPayload,
    DocumentDeleted,
    DocumentMetadata,
    DocumentReverted,
    DocumentUpserted,
    LinkAdded,
    LinkRemoved,
    LinkReverted,
    NodeRemoved,
    NodeReverted,
    NodeUpserted,
    OntologyLink,
    OntologyNode,
    SecondVector,
    SemanticDocument,
    TokenVectors,
    split_link_key,
)
from ontofabric.contracts.documents import (
    MAX_ALIASES,
    MAX_CALLEE_CHARS,
    MAX_CALLS,
    MAX_DEFINES,
    MAX_METADATA_BYTES,
    stored_json_bytes,
)
from ontofabric.contracts.path_patterns import matches, pattern_problem, unescaped, within_the_tree
from ontofabric.shared.embedder import Embedder, EmbedderMismatch
from ontofabric.shared.embedding_cache import Embedded, EmbeddingCache, embed_with_signs, longest_first
from ontofabric.shared.jetstream import MAX_DELTA_MESSAGE_BYTES, connection_of
from ontofabric.shared.logging import get_logger
from ontofabric.shared.manifest_store import ManifestChanged, ManifestStore, ManifestUnavailable, StoredManifest
from ontofabric.shared.onnx_models import OnnxEmbedder, pack_half
from ontofabric.shared.progress import Progress, Silent
from ontofabric.shared.subjects import Names
from ontofabric.shared.tasks import still_wanted
from ontofabric.shared.telemetry import tracer

from .chunking import DOCUMENT_FORMATS, Chunk, chunk_file, self_import_name, tree_package, utf8_size
from .client import DeltaPublisher, PublishFailed, envelope
from .code import CODE_SUFFIXES, crate_roots, index_aliases, rust_aliases
from .code_graph import CodeRead, go_module_path, read_code, rust_crate_name
from .graph import (
    GraphLink,
    GraphNode,
    PythonTree,
    defining_files,
    python_calls,
    python_exports,
    python_graph,
    read_python,
)
from .ignored import GitIgnores
from .reading import read_regular_file

log = get_logger(__name__)

SKIPPED_DIRECTORIES = {
    "__pycache__", "node_modules", "build", "dist", "site-packages", "venv", ".venv", ".git", ".tox", ".eggs",
    "vendor",
}  # fmt: skip
"""Directories of tools' output and of others' code, left out at any depth (as are hidden ones and
``*.egg-info``), unless they hold an ``__init__.py``: then they are a package of the tree (pip's
``operations/build`` was left out, an ingest tester's; pip's ``_vendor`` is its own). ``vendor``: Go's and PHP's
dependencies, whose READMEs ranked above a monorepo tester's own for "how do I run the tests". And ``target``
beside a ``Cargo.toml`` or ``pom.xml``: Rust's and Maven's build output (a Java or Go package may be named so)."""
VISIBLE_HIDDEN_DIRECTORIES = {".github"}
"""Hidden directories read all the same: a repository's CI workflows and templates (a monorepo tester's "what does
the deploy workflow do" found nothing)."""
SOURCE_SUFFIXES = (".py", *DOCUMENT_FORMATS, *CODE_SUFFIXES)
SOURCES_READ = ", ".join(SOURCE_SUFFIXES)
"""The suffixes read, as an ingest's messages list them."""
LOCKFILES = frozenset({"pnpm-lock.yaml"})
"""Files under a source suffix that a package manager writes: thousands of lines no question is about."""
EMBED_BATCH = 64


GONE_OR_NO_FILE = (None, errno.ENOENT, errno.ELOOP, errno.ENOTDIR)
"""Why a source file read fails when it is rightly no document (gone since the walk, a link, no regular file, no
text: errors without an errno); any other (access denied, a failing disk or mount) leaves it unread."""


class ExclusionRefused(ValueError):
    """An ``--exclude`` that names nothing in the tree, or that would leave nothing of it."""


class ReadingStopped(Exception):
    """The ingest that a tree's reading was for was cancelled (:meth:`Ingester._read`)."""


class EmptyTreeRefused(ValueError):
    """A tree with no source file, whose ingest would delete everything the last one published (a wrong path, a
    volume not mounted): refused unless asked for."""


def exclusion_patterns(root: Path, patterns: Iterable[str]) -> tuple[str, ...]:
    """``patterns`` as :func:`matches` reads them, each once and sorted (the same set of patterns reads the same):
    backslashes as :func:`unescaped` reads them, without a leading ``./`` or a trailing ``/``, an absolute one made
    relative to ``root``. ExclusionRefused for one that can match nothing in the tree (empty, ``.``, outside it)."""
    normal = []
    for written in patterns:
        problem = pattern_problem(written)
        if problem is not None:
            raise ExclusionRefused(f"--exclude {problem}")
        pattern = unescaped(written)
        if pattern.startswith("/"):
            try:
                pattern = Path(pattern).relative_to(root.resolve()).as_posix()
            except ValueError:
                raise ExclusionRefused(f"--exclude {written!r} is outside the tree {root}") from None
        normalised = within_the_tree(pattern)
        if normalised is None:
            raise ExclusionRefused(f"--exclude {written!r} names no path inside the tree")
        normal.append(normalised)
    return tuple(sorted(set(normal)))


def _tools_output(directory: Path, name: str) -> bool:
    """Whether a directory is left out as hidden or as tools' output (:data:`SKIPPED_DIRECTORIES`)."""
    if name.startswith("."):
        return name not in VISIBLE_HIDDEN_DIRECTORIES
    try:
        if name == "target":  # Rust's and Maven's build output, beside what builds it; else a name like any other
            return any((directory / marker).is_file() for marker in ("Cargo.toml", "pom.xml"))
        if name not in SKIPPED_DIRECTORIES and not name.endswith(".egg-info"):
            return False
        return not (directory / name / "__init__.py").is_file()
    except OSError:  # not to be looked into: as it was before packages were told apart (a review's traceback)
        return True


def discover(
    root: Path,
    exclude: Collection[str] = (),
    unread: list[str] | None = None,
    gitignore: bool = True,
    ignored: list[str] | None = None,
    other_kinds: Counter[str] | None = None,
) -> Iterator[Path]:
    """Source files under ``root``, in a stable order, skipping hidden and generated directories, what ``exclude``
    names (:func:`matches`) and, with ``gitignore``, what ``.gitignore`` files leave out (:class:`GitIgnores`;
    each such source file and directory, relative to ``root``, added to ``ignored``, a directory with a trailing
    ``/``). A directory that cannot be listed is logged and, relative to ``root``, added to ``unread``. The other
    files neither leaves out, hidden ones aside (``.gitignore``), are counted in ``other_kinds`` (:func:`file_kind`)."""
    ignores = GitIgnores(root) if gitignore else None

    def unlisted(error: OSError) -> None:
        log.warning("ingest_directory_unread", path=repr(str(error.filename)), error=str(error))
        if unread is not None and error.filename is not None:
            unread.append(Path(os.fsdecode(error.filename)).relative_to(root).as_posix())

    for directory, subdirectories, files in _walk(root, unlisted):
        here = Path(directory).relative_to(root).as_posix()
        prefix = "" if here == "." else f"{here}/"
        if ignores is not None:
            ignores.enter(prefix.rstrip("/"))
        kept = []
        for name in sorted(subdirectories):
            if matches(prefix + name, exclude):
                continue
            if _tools_output(Path(directory), name):
                log.debug("ingest_directory_skipped", path=prefix + name)
            elif ignores is not None and ignores.ignored(prefix + name, is_directory=True):
                log.debug("ingest_directory_ignored", path=prefix + name)
                if ignored is not None:
                    ignored.append(f"{prefix}{name}/")
            elif os.path.islink(os.path.join(directory, name)):  # listed, not gone into: said, as for a file
                link = "a symbolic link (links are not followed)"
                log.warning("ingest_directory_skipped", path=prefix + name, error=link)
            else:
                kept.append(name)
        subdirectories[:] = kept
        for name in sorted(files):
            source = name.endswith(SOURCE_SUFFIXES) and name not in LOCKFILES
            if (not source and (other_kinds is None or name.startswith("."))) or matches(prefix + name, exclude):
                continue
            if ignores is not None and ignores.ignored(prefix + name, is_directory=False):
                log.debug("ingest_file_ignored", path=prefix + name)
                if ignored is not None and source:
                    ignored.append(prefix + name)
            elif source:
                yield Path(directory) / name
            elif other_kinds is not None:
                other_kinds[file_kind(name)] += 1


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cycle collector paused while a tree is read: its parsed files hold millions of objects, none in a
    cycle, and every full collection went through them all again (sympy's 1,534 files: parsed in 33 s, 9 s
    without; docs/benchmarks.md). What is freed meanwhile is freed by its count of references, as ever; cycles
    wait until after."""
    paused = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if paused:
            gc.enable()


def file_kind(name: str) -> str:
    """What kind of file a name says: its suffix (``.kt``; ``.MD`` is not ``.md``, which is read), else the name
    (``Dockerfile``, a lockfile's)."""
    suffix = Path(name).suffix
    return suffix if suffix and suffix != name and name not in LOCKFILES else name


def _walk(root: Path, unlisted: Callable[[OSError], None]) -> Iterator[tuple[str, list[str], list[str]]]:
    """``os.walk(root, onerror=unlisted)`` (top down, links to directories listed, the caller pruning the
    subdirectories it yields: :func:`discover` keeps no link), without recursion: os.walk recurses, and a tester's
    tree 1,100 directories deep ended the ingest in a RecursionError."""
    waiting = [os.fspath(root)]
    while waiting:
        directory = waiting.pop()
        try:
            with os.scandir(directory) as listing:
                entries = list(listing)
        except OSError as error:
            unlisted(error)
            continue
        subdirectories: list[str] = []
        files: list[str] = []
        for entry in entries:
            try:
                is_directory = entry.is_dir()
            except OSError:  # as os.walk takes it: not a directory
                is_directory = False
            (subdirectories if is_directory else files).append(entry.name)
        yield directory, subdirectories, files
        waiting.extend(os.path.join(directory, name) for name in reversed(subdirectories))


def read_tree(
    root: Path,
    exclude: Collection[str] = (),
    unread: list[str] | None = None,
    max_read_bytes: int = 0,
    gitignore: bool = True,
    ignored: list[str] | None = None,
    other_kinds: Counter[str] | None = None,
) -> dict[str, str]:
    """Relative path -> text of every source file under ``root`` but those ``exclude`` names (:func:`matches`)
    and, with ``gitignore``, those ``.gitignore`` files leave out (listed in ``ignored``: :func:`discover`);
    files that are not text, or no regular file, are skipped, logged. What could not be read otherwise (access
    denied, a failing disk or mount), a file or a directory, is also added to ``unread``: it may still hold what
    it held. Of a file over ``max_read_bytes`` (0: none is) only that much is read (a :class:`FileStart`). The
    files of other kinds are counted in ``other_kinds`` (:func:`discover`)."""
    sources: dict[str, str] = {}
    for path in discover(root, exclude, unread, gitignore, ignored, other_kinds):
        relative = path.relative_to(root).as_posix()
        # Each file named by its path in the tree, in every line about it (a tester's read absolute, quoted or not,
        # or the file's name alone); one holding what a terminal acts on, or bytes that are no UTF-8, as Python
        # writes it.
        shown = relative if relative.isprintable() else repr(relative)
        try:
            relative.encode("utf-8")  # a name of bytes that are no UTF-8: no document id can carry it
            text = read_regular_file(path, max_read_bytes, shown)
        # SyntaxError: a coding line naming no codec; LookupError: one naming no text codec (rot13, a review's).
        except (UnicodeError, OSError, SyntaxError, LookupError) as error:
            log.warning("ingest_file_skipped", path=shown, error=str(error))
            if unread is not None and getattr(error, "errno", None) not in GONE_OR_NO_FILE:
                unread.append(relative)
            continue
        if "\0" in text:  # no text field may hold NUL: a binary file under a source suffix
            log.warning("ingest_file_skipped", path=shown, error="it holds NUL characters: not text")
            continue
        sources[relative] = text
    return sources


def own_package(root: Path, named: str | None = None) -> str | None:
    """The package name a tree's modules are named after (:func:`chunking.tree_package`), read from the tree's
    own ``__init__.py`` whether or not an ``--exclude`` leaves it out: names must not change with that."""
    return tree_package(root.name, ["__init__.py"] if (root / "__init__.py").is_file() else [], named)


def imported_package(root: Path, sources: Mapping[str, str]) -> str | None:
    """The name a tree that is a package is imported by in its own files, when that is not its directory's name
    (:func:`chunking.self_import_name`): a package checked out under another name. None otherwise, and for a tree
    that is no package: its absolute imports resolve to its files by their own names (a package below its top
    too: ``graph._import_names``)."""
    if not (root / "__init__.py").is_file():
        return None
    return self_import_name(sources, own_package(root))


def too_large(sources: Mapping[str, str], max_file_bytes: int) -> dict[str, str]:
    """The files of ``sources`` over ``max_file_bytes`` (0: none is), each with why it is read as one chunk."""
    if not max_file_bytes:
        return {}
    sizes = {path: utf8_size(text) for path, text in sources.items()}
    return {
        path: f"{size:,} bytes, over ONTOFABRIC_INGEST_MAX_FILE_BYTES ({max_file_bytes:,}): read as one chunk"
        for path, size in sizes.items()
        if size > max_file_bytes
    }


def python_of(
    sources: Mapping[str, str], package: str | None, max_file_bytes: int, tick: Callable[[], object] = lambda: None
) -> PythonTree:
    """:func:`graph.read_python` of the files of ``sources`` within ``max_file_bytes`` (:func:`too_large`)."""
    unread = too_large(sources, max_file_bytes)
    return read_python({path: text for path, text in sources.items() if path not in unread}, package, tick)


def read_sources(
    root: Path,
    sources: Mapping[str, str],
    package: str | None,
    max_content_bytes: int,
    max_file_bytes: int,
    tick: Callable[[], object] = lambda: None,
) -> tuple[list[Chunk], tuple[list[GraphNode], list[GraphLink]], dict[str, str]]:
    """What an ingest reads of a tree's ``sources`` (from :func:`read_tree`): its chunks, its graph, and the file
    defining each node (:func:`chunk_sources`, :func:`graph.python_graph`, :func:`graph.defining_files`), the
    Python files parsed once for all three. ``tick`` is called :func:`reading_steps` times as it goes (and may raise
    to stop it: an interrupted ingest waited a minute for the reading to end)."""
    with collector_paused():
        python = python_of(sources, package, max_file_bytes, tick)
        code = code_of(root, sources, max_file_bytes, tick)
        chunked = chunk_sources(root, sources, max_content_bytes, package or "", python, max_file_bytes, tick, code)
        nodes, links = python_graph(python, tick=tick)
        # Where a Python file and another make the same node (pkg/api.py and pkg/api.ts), Python's alone: the
        # other's node, links and file would be taken for Python's (a second review's).
        python_types = {node.object_type for node in nodes}
        nodes += [node for node in code.nodes if node.object_type not in python_types]
        links += [link for link in code.links if not {link.source_type, link.target_type} & python_types]
        defined_in = {t: path for t, path in code.defined_in.items() if t not in python_types}
        return chunked, (sorted(nodes, key=lambda n: n.object_type), sorted(links)), defined_in | defining_files(python)


def code_of(
    root: Path, sources: Mapping[str, str], max_file_bytes: int, tick: Callable[[], object] = lambda: None
) -> CodeRead:
    """:func:`code_graph.read_code` of the files of ``sources`` in other languages than Python, within
    ``max_file_bytes`` (:func:`too_large`); ``tick`` called before each file is read, twice."""
    unread = too_large(sources, max_file_bytes)
    code = {path: text for path, text in sources.items() if path.endswith(CODE_SUFFIXES) and path not in unread}
    return read_code(code, go_modules(root, code), rust_crates(root, code), tick)


def reading_steps(sources: Mapping[str, str]) -> int:
    """How many times :func:`read_sources` ticks: each Python file parsed, each file chunked, each Python file's
    calls and links read, each other code file's declarations and calls read (at most)."""
    python = sum(1 for path in sources if path.endswith(".py"))
    return len(sources) + 3 * python + 2 * sum(1 for path in sources if path.endswith(CODE_SUFFIXES))


def chunk_sources(
    root: Path,
    sources: Mapping[str, str],
    max_content_bytes: int,
    package: str | None = None,
    python: PythonTree | None = None,
    max_file_bytes: int = 0,
    tick: Callable[[], object] = lambda: None,
    code: CodeRead | None = None,
) -> list[Chunk]:
    """The chunks of a tree's ``sources`` (from :func:`read_tree`), named as Python imports them (``package``: see
    :func:`chunking.tree_package`); code chunks carry the symbols their code calls (:func:`graph.python_calls`,
    :func:`code_graph.read_code` in other languages: ``code``, when already read).
    ``python``: the sources as :func:`graph.read_python` read them with that package, when already read (without
    the files over ``max_file_bytes``, which are read as one chunk each: :func:`too_large`). ``tick``: called
    before each file is chunked and each module's calls are read."""
    package = tree_package(root.resolve().name, sources, package)
    unread = too_large(sources, max_file_bytes)
    python = python if python is not None else python_of(sources, package, max_file_bytes)
    chunks = []
    for path, text in sources.items():
        tick()
        chunks += chunk_file(path, text, max_content_bytes, package, python.parsed(path), unread.get(path))
    calls = {key: carried_calls(names) for key, names in python_calls(python, tick=tick).items()}
    code = code if code is not None else code_of(root, sources, max_file_bytes, tick)
    calls |= {key: carried_calls(names) for key, names in code.calls.items()}
    exports = python_exports(python)
    crate_names = crate_roots(rust_crates(root, sources))
    completed = []
    for chunk in chunks:
        if chunk.parse_error is not None:
            log.warning("ingest_file_unparsed", path=chunk.file_path, error=chunk.parse_error)
        if chunk.cut_from_bytes is not None:  # a tester's 2 MB file was cut without a word
            log.warning(
                "ingest_chunk_cut",
                path=chunk.file_path,
                symbol=chunk.symbol_fqn,
                size_bytes=chunk.cut_from_bytes,
                kept_bytes=max_content_bytes,
                reason="longer than ONTOFABRIC_MAX_CONTENT_BYTES: only its start is indexed",
            )
        # What the chunk is named by already (a Go or Java package's name), a Rust declaration's path in its crate,
        # then what the tree's Python publishes.
        of_python = chunk.chunk_level != "doc" and chunk.source_domain == "python"  # app/models.ts: no app.models
        published = [*chunk.aliases, *(_aliases(chunk, exports) if of_python else [])]
        if chunk.source_domain == "rust":
            published += rust_aliases(chunk.file_path, chunk.symbol_fqn, crate_names)
        elif chunk.source_domain in ("typescript", "javascript"):
            published += index_aliases(chunk.file_path, chunk.symbol_fqn)
        elif chunk.source_domain == "go" and chunk.chunk_level == "file":  # its package's names, where it stands for it
            published += code.package_names.get(chunk.file_path, ())
        if of_python:  # a src layout's, by its import name
            own, *others = [python.imported_as(name) for name in [chunk.symbol_fqn, *published]]
            named = [*([own] if own else []), *published, *(name for name in others if name)]
            published = list(dict.fromkeys(named))
        kept = carried_aliases(published)
        # A tester's 10,000 assigned names went unsaid, and a review's package's own name for a constant.
        for kind, names, carried in (
            ("assigned", chunk.defines, carried_defines(chunk.defines)),
            ("published", published, kept),
        ):
            if len(carried) < len(names):
                log.warning(
                    "ingest_names_cut", path=chunk.file_path, symbol=chunk.symbol_fqn, kind=kind, names=len(names),
                    kept=len(carried),
                    reason="more names than a document's metadata carries: those after are not found by name",
                )  # fmt: skip
        if chunk.chunk_level != "doc":
            chunk = replace(chunk, calls=calls.get((chunk.file_path, chunk.symbol_fqn, chunk.line), ()), aliases=kept)
        completed.append(chunk)
    return completed


def go_modules(root: Path, sources: Iterable[str]) -> dict[str, str]:
    """The module path each ``go.mod`` in a directory above the Go files of ``sources`` declares (a monorepo may
    hold several), by its directory in the tree (``""``: the top): what tells an import of the tree's packages
    from another module's."""
    return _declared_above(root, sources, ".go", "go.mod", go_module_path)


def rust_crates(root: Path, sources: Iterable[str]) -> dict[str, str]:
    """The name each ``Cargo.toml`` in a directory above the Rust files of ``sources`` gives its crate, by its
    directory: what its tests and the workspace's other crates call it by (``anyhow::Error``)."""
    return _declared_above(root, sources, ".rs", "Cargo.toml", rust_crate_name)


def _declared_above(
    root: Path, sources: Iterable[str], suffix: str, manifest: str, declared: Callable[[str], str | None]
) -> dict[str, str]:
    """What ``declared`` reads of each file named ``manifest`` in a directory above the files of ``sources``
    ending in ``suffix``, by its directory in the tree (``""``: the top)."""
    directories = {str(parent) for path in sources if path.endswith(suffix) for parent in Path(path).parents}
    found = {}
    for directory in directories:
        with contextlib.suppress(OSError, UnicodeError):
            value = declared(read_regular_file(root / directory / manifest, 64 * 1024))
            if value is not None:
                found["" if directory == "." else directory] = value
    return found


def _aliases(chunk: Chunk, exports: Mapping[str, Sequence[str]]) -> list[str]:
    """The names the chunk's symbol is published under, and those of the names it assigns (a module's chunk:
    ``pytest.skip`` for its ``skip``), the shortest first: only so many are carried, and a package's own name for
    one (``lib.skip``) went after 64 others' star imports of its constants (a review's)."""
    assigned = (name for defined in chunk.defines for name in exports.get(f"{chunk.symbol_fqn}.{defined}", ()))
    return sorted(dict.fromkeys([*exports.get(chunk.symbol_fqn, ()), *assigned]), key=lambda name: name.count("."))


CALLS_BYTES = MAX_METADATA_BYTES // 2
"""The share of a document's metadata its calls may take; the rest is its names and paths."""


DEFINES_BYTES = MAX_METADATA_BYTES // 4
"""The share of a document's metadata the names it assigns may take (beside its calls' half)."""
ALIASES_BYTES = MAX_METADATA_BYTES // 16
"""The share of a document's metadata the names its symbol is published under may take."""


def carried_calls(names: Sequence[str]) -> tuple[str, ...]:
    """The calls the contract can carry, in order: what it cannot (a name past its length, calls past their count
    or their share of the metadata) is left out, so that one odd source never stops an ingest."""
    return _carried(names, CALLS_BYTES, MAX_CALLS)


def carried_defines(names: Sequence[str]) -> tuple[str, ...]:
    """The assigned names the contract can carry, in order, as :func:`carried_calls` keeps calls."""
    return _carried(names, DEFINES_BYTES, MAX_DEFINES)


def carried_aliases(names: Sequence[str]) -> tuple[str, ...]:
    """The published names the contract can carry, in order, as :func:`carried_calls` keeps calls."""
    return _carried(names, ALIASES_BYTES, MAX_ALIASES)


def _carried(names: Sequence[str], share_bytes: int, count: int) -> tuple[str, ...]:
    kept: list[str] = []
    size = 0
    for name in names:
        if len(name) > MAX_CALLEE_CHARS:
            continue
        size += stored_json_bytes(name) + 2
        if size > share_bytes or len(kept) == count:
            break
        kept.append(name)
    return tuple(kept)


def _derived_state(chunk: Chunk) -> str:
    """What the manifest keeps of a chunk's calls, assigned names, names past ASCII and lines, beside its content:
    nothing of calls or names when it has none, so that chunks without them keep the values they had before either
    was carried.
    Lines move when an edit above the chunk adds or removes some: it goes again with its new lines, its vectors
    from the embedding cache (its text is unchanged). A chunk with no text goes without vectors: said, so that one
    sent with a vector of its name alone before that is sent again (a review's)."""
    calls = f"|calls:{hashlib.sha256(chr(10).join(chunk.calls).encode()).hexdigest()[:16]}" if chunk.calls else ""
    lines = f"|lines:{chunk.lines[0]}-{chunk.lines[1]}" if chunk.lines is not None else ""
    vectors = "" if chunk.content.strip() else "|no-vectors"
    # Names past ASCII, which a release may read otherwise from the same path and content (in the form Python
    # reads names in, object types keeping their letters): a review's renamed names never reached the documents of
    # files that did not change. Only for such names, so that others keep the values they had.
    named = (chunk.symbol_fqn, chunk.object_type)
    written = (chunk.symbol_key, *named)  # the key holds the path and the names as written: `ﬁle.ts` is `file` now
    derived = {
        "defines": carried_defines(chunk.defines),
        "aliases": chunk.aliases,
        "names": () if all(name.isascii() for name in written) else named,
    }
    return (
        calls
        + lines
        + vectors
        + "".join(
            f"|{kind}:{hashlib.sha256(chr(10).join(names).encode()).hexdigest()[:16]}"
            for kind, names in derived.items()
            if names
        )
    )


def chunk_tree(root: Path, max_content_bytes: int) -> list[Chunk]:
    return chunk_sources(root, read_tree(root), max_content_bytes)


# ---------------------------------------------------------------------------------------------- diff


TOMBSTONE = "-"
"""A manifest value: the branch hides main's entity of this key."""
DELETED_FILE = "-f"
"""A manifest value: the branch hides main's document of this key, and every other of its file, which the branch
deleted (its tombstone names the file: ``deletedFile``)."""
REMOVED = (TOMBSTONE, DELETED_FILE)
UNKNOWN = "?"
"""The hash of a key two racing ingests disagreed on: it matches nothing, so the next ingest sends it again."""
SAVE_ATTEMPTS = 5


@dataclass(frozen=True)
class Manifest:
    """What the last ingest left on a branch: entity key -> content hash (or, on a branch, TOMBSTONE or
    DELETED_FILE).

    Keys name the entity kind: ``d:<document id>``, ``n:<object type>``, ``l:<source>|<link>|<target>``. On a
    branch the manifest holds only the branch's delta over main, as the branch stores it.
    """

    entries: dict[str, str] = field(default_factory=dict)
    exclude: tuple[str, ...] | None = None
    """The ``--exclude`` patterns of the ingest that saved it (normalised), so the next can say when they differ;
    None where they were not recorded (no manifest, or one saved before they were)."""
    files: dict[str, str] = field(default_factory=dict)
    """Document key -> its file, for the keys of ``entries`` whose file is known: what tells a branch which file
    it changed when it only removes a document (a file's last section), or deletes a whole file, of main's.
    Empty in a manifest saved before it was recorded."""
    package: str | None = None
    """The package the ingest that saved it named the tree's modules after ("" for none), so that a branch's
    checkout in a directory of another name is named as main was; None where not recorded."""
    published_through: int | None = None
    """The stream sequence of the last delta an ingest of the branch published: what the index must reach before
    the branch's content, as the entries say it, is there; None where not recorded (nothing published yet, or a
    manifest saved before it was)."""
    published_from: int | None = None
    """The stream sequence of the first delta that ingest published: its dead letters are those from here to
    ``published_through`` (a branch's earlier ones were superseded by it)."""

    @property
    def unknown(self) -> int:
        return sum(1 for value in self.entries.values() if value == UNKNOWN)

    @property
    def digest(self) -> str:
        return hashlib.sha256(json.dumps(self.entries, sort_keys=True).encode()).hexdigest()

    def to_json(self) -> bytes:
        document: dict[str, object] = {"version": 2, "entries": self.entries}
        if self.exclude is not None:  # an earlier release ignores the key (and drops it if it saves)
            document["exclude"] = list(self.exclude)
        keys_by_file: dict[str, list[str]] = {}  # each path once, not once a key
        for key, path in self.files.items():
            if key in self.entries:
                keys_by_file.setdefault(path, []).append(key)
        if keys_by_file:  # likewise ignored by an earlier release
            document["files"] = {path: sorted(keys) for path, keys in keys_by_file.items()}
        if self.package is not None:
            document["package"] = self.package
        if self.published_through is not None:
            document["published_through"] = self.published_through
        if self.published_from is not None:
            document["published_from"] = self.published_from
        return json.dumps(document, sort_keys=True).encode()

    def merged_with(self, other: Manifest) -> Manifest:
        """What the index may hold after two ingests published from one manifest at once: a key both left alike
        is known; any other key is UNKNOWN, so the next ingest sends it again or removes it."""
        mine, theirs = self.entries, other.entries
        merged = {k: mine[k] if mine.get(k) == theirs.get(k) else UNKNOWN for k in mine.keys() | theirs.keys()}
        through = [n for n in (self.published_through, other.published_through) if n is not None]
        first = [n for n in (self.published_from, other.published_from) if n is not None]
        return Manifest(
            merged, self.exclude, {**other.files, **self.files}, self.package, max(through, default=None),
            min(first, default=None),
        )  # fmt: skip

    @classmethod
    def from_json(cls, data: bytes) -> Manifest:
        stored = json.loads(data)
        entries = dict(stored["entries"])
        if stored.get("version", 1) == 1:  # version 1 knew only documents and keyed them by bare id
            entries = {f"d:{key}": value for key, value in entries.items()}
        recorded = stored.get("exclude")
        files = {key: path for path, keys in stored.get("files", {}).items() for key in keys}
        return cls(
            entries,
            None if recorded is None else tuple(recorded),
            files,
            stored.get("package"),
            _sequence(stored.get("published_through")),
            _sequence(stored.get("published_from")),
        )


def _sequence(value: object) -> int | None:
    """A stream sequence as a manifest stored it; None for anything else (not recorded, or written by hand)."""
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _manifest_of(stored: StoredManifest) -> Manifest:
    return Manifest.from_json(stored.data) if stored.data is not None else Manifest()


@dataclass(frozen=True)
class IngestPlan:
    upserts: list[str]
    deletes: list[str]
    """Keys to remove: on main, gone from the tree; on a branch, main has them and the tree does not."""
    reverts: list[str]
    """Branch keys whose change is gone: main's version shows through again."""
    unchanged: int
    manifest: Manifest
    """The manifest once this plan is published."""
    whole_file: frozenset[str] = frozenset()
    """On a branch: the keys of ``upserts`` of a file the branch holds whole (their documents say so)."""

    @property
    def deleted_files(self) -> dict[str, str]:
        """On a branch: each of ``deletes`` of a file the branch deleted whole, with that file (its delta says so)."""
        entries, files = self.manifest.entries, self.manifest.files
        return {k: files[k] for k in self.deletes if entries.get(k) == DELETED_FILE and k in files}


def as_far_as_read(desired: Mapping[str, str], previous: Manifest, main: Manifest | None = None) -> dict[str, str]:
    """``desired`` for an ingest that could not read part of the tree: a document's new or changed text is sent,
    and what is read from the whole tree stays as the branch holds it, since part of it is missing (an unchanged
    document's calls, the graph: a review found a file's calls and bases lost to the one not read). Keys the tree
    did not give are left to :func:`without_removals`."""
    held = {**(main.entries if main is not None else {}), **previous.entries}
    kept = {}
    for key, value in desired.items():
        before = held.get(key)
        if key.startswith("d:") and _text(before) != _text(value):
            kept[key] = value  # its text is new: sent
        elif before is not None and before not in REMOVED:
            kept[key] = before
    return kept


def without_removals(plan: IngestPlan, previous: Manifest) -> IngestPlan:
    """``plan`` with nothing taken out of the branch (no delete, tombstone or revert), its manifest keeping what
    the branch held of those keys, so that the next ingest that reads the whole tree removes what is gone."""
    entries, files = dict(plan.manifest.entries), dict(plan.manifest.files)
    for key in [*plan.deletes, *plan.reverts]:
        files.pop(key, None)
        if key in previous.entries:
            entries[key] = previous.entries[key]
            if key in previous.files:
                files[key] = previous.files[key]
        else:  # a tombstone it would have added
            entries.pop(key, None)
    manifest = Manifest(entries, plan.manifest.exclude, files, plan.manifest.package)
    return replace(plan, deletes=[], reverts=[], manifest=manifest)


def plan_ingest(
    desired: Mapping[str, str],
    previous: Manifest,
    main: Manifest | None = None,
    files: Mapping[str, str | None] | None = None,
    graph_files: Mapping[str, str] | None = None,
) -> IngestPlan:
    """What to publish so the branch holds ``desired`` (key -> hash): on main everything that changed; on a
    branch (``main`` given) what differs from main, as overrides, tombstones and reverts, and with a document that
    differs, or one of main's that is gone, every other document of its file (``files``: each document key's
    file; main's keys' files from its manifest), and every graph node and link of it (``graph_files``: the file
    each is defined in). A query on the branch reads main's documents of such a file as hidden
    (services/query/postgres.py, ``_shadowed_ids``), and main's graph rows of its module (services/query/graph.py,
    ``overlay``), and those of a file the branch deleted, which its tombstones name: its chunks that matched main's
    at this ingest showed main's later changes, lines included, and went with main's deletion of the file, and
    its graph took main's later bases and imports (outside testers')."""
    base = main.entries if main is not None else {}
    target = {k: h for k, h in desired.items() if base.get(k) != h}
    # Each key's file: the tree's, else main's manifest's, else the branch's own record (main's manifest saved by
    # a release that records none would otherwise take back what the branch holds, a reviewer's).
    file_of = {
        **previous.files,
        **(main.files if main is not None else {}),
        **{k: f for k, f in (files or {}).items() if f},
    }
    deleted_files: dict[str, str] = {}
    whole_file: frozenset[str] = frozenset()
    if main is not None:
        removed = [k for k in base if k not in desired]
        if files is not None:
            present = {path for path in files.values() if path is not None}
            # A file is the branch's when its text differs from main's: a document of it new, changed or gone. One
            # whose documents differ only in what other files make of them (the calls of a function that moved)
            # follows main, those documents overriding main's by id (an outside tester's: moving a function took
            # every file calling it whole, and main's later changes to those files stopped showing on the branch).
            owned = {files[k] for k in target if files.get(k) is not None and _text(target[k]) != _text(base.get(k))}
            owned |= {file_of[k] for k in removed if file_of.get(k) in present}  # only a section taken out
            graph_of = graph_files or {}
            target.update({k: h for k, h in desired.items() if (files.get(k) or graph_of.get(k)) in owned})
            whole_file = frozenset(k for k in target if files.get(k) in owned)
            deleted_files = {k: file_of[k] for k in removed if k in file_of and file_of[k] not in present}
        target.update({k: DELETED_FILE if k in deleted_files else TOMBSTONE for k in removed})
    upserts = sorted(k for k, h in target.items() if h not in REMOVED and previous.entries.get(k) != h)
    # A tombstone goes again when what it says changes: a file deleted, or back (one sent before files were
    # recorded is TOMBSTONE, and goes again once, naming its file).
    tombstones = sorted(k for k, h in target.items() if h in REMOVED and previous.entries.get(k) != h)
    gone = sorted(k for k in previous.entries if k not in target)
    deletes, reverts = (tombstones, gone) if main is not None else (gone, [])
    unchanged = len(desired) - sum(1 for k in upserts if k in desired)
    recorded = {k: file_of[k] for k in target if k in file_of}
    manifest = Manifest(target, files=recorded)
    return IngestPlan(upserts, deletes, reverts, unchanged, manifest, whole_file)


def _text(value: str | None) -> str | None:
    """The part of a manifest value that is the document's text (its content hash), without what is derived."""
    return None if value is None else value.split("|", 1)[0]


DELTA_HEADER_ROOM_BYTES = 1024
"""Room left beside a delta's JSON for the headers it is published with (message id, trace context)."""


def fits(delta: DeltaEnvelope, limit: int) -> bool:
    """Whether the delta, as JSON, takes at most ``limit`` bytes. Serialised only when its text could make it
    larger: JSON writes a control character in six bytes, and a chunk's limit counts it as one."""
    payload = delta.payload
    text = payload.document.content if isinstance(payload, DocumentUpserted) else ""
    if 6 * len(text.encode()) + 64 * 1024 <= limit:  # the text escaped at worst, and room for the rest
        return True
    return len(delta.model_dump_json(exclude_none=True).encode()) <= limit


def event_id(workspace: str, branch: str, base: str, key: str, change: str) -> str:
    """Deterministic for a rerun from the same stored manifest (the projector applies it once), new after any change
    and after any ingest that saved one: ``base`` names the stored manifest's generation, so a tree that goes back
    to an earlier state gets new ids, where the same ids were dropped as repeats and left the index stale."""
    material = "|".join([workspace, branch, base, key, change])
    return hashlib.sha256(material.encode()).hexdigest()[:40]


def node_hash(node: GraphNode) -> str:
    return hashlib.sha256(json.dumps([node.domain, node.name, node.kind, node.interfaces]).encode()).hexdigest()


@dataclass(frozen=True)
class ChunkEmbedding:
    vector: list[float]
    token_vectors: TokenVectors | None
    second_vector: SecondVector | None = None

    @staticmethod
    def of(
        embedded: Embedded, dimension: int, token_vectors: bool, second: SecondVectors | None = None
    ) -> list[ChunkEmbedding]:
        """What goes on the wire for each embedded text: its vector, its tokens' signs unless turned off or the
        model has none as wide as its vectors, and its second model's vector when there is one."""
        seconds = [None] * len(embedded.vectors) if second is None else second.on_the_wire()
        return [
            ChunkEmbedding(
                [float(x) for x in row],
                TokenVectors.of_signs(dimension, signs) if token_vectors and signs else None,
                extra,
            )
            for row, signs, extra in zip(embedded.vectors, embedded.token_signs, seconds, strict=True)
        ]


@dataclass(frozen=True)
class SecondVectors:
    """Texts' vectors by the second embedding model, in the texts' order."""

    model: str
    vectors: npt.NDArray[np.float32]

    @staticmethod
    def of(
        embedder: OnnxEmbedder | None, texts: Sequence[str], cache: EmbeddingCache | None = None
    ) -> SecondVectors | None:
        """``texts`` embedded by the second model (through ``cache`` when given); None without a second model."""
        if embedder is None:
            return None
        vectors = embedder.embed(texts) if cache is None else cache.vectors(embedder.name, embedder.embed, texts)
        return SecondVectors(embedder.name, vectors)

    def on_the_wire(self) -> list[SecondVector | None]:
        return [SecondVector.of_half(self.model, pack_half(row)) for row in self.vectors]


def to_document(
    chunk: Chunk, embedded: ChunkEmbedding | None, embedding_model: str | None, whole_file: bool = False
) -> SemanticDocument:
    """``whole_file``: on a branch, which sends every chunk of each file it changes (``plan_ingest``)."""
    return SemanticDocument(
        id=chunk.document_id,
        content=chunk.content,
        object_type=chunk.object_type,
        source_domain=chunk.source_domain,
        metadata=DocumentMetadata(
            symbol_key=chunk.symbol_key,
            symbol_kind=chunk.symbol_kind,
            symbol_fqn=chunk.symbol_fqn,
            content_hash=chunk.content_hash,
            file_path=chunk.file_path,
            start_line=chunk.lines[0] if chunk.lines is not None else None,
            end_line=chunk.lines[1] if chunk.lines is not None else None,
            chunk_level=chunk.chunk_level,
            provenance="ingested",
            calls=list(chunk.calls) or None,
            defines=list(carried_defines(chunk.defines)) or None,
            aliases=list(chunk.aliases) or None,
            whole_file=whole_file or None,
        ),
        embedding=embedded.vector if embedded is not None else None,
        embedding_model=embedding_model if embedded is not None else None,
        token_vectors=embedded.token_vectors if embedded is not None else None,
        second_vector=embedded.second_vector if embedded is not None else None,
    )


# --------------------------------------------------------------------------------------------- run


@dataclass(frozen=True)
class IngestReport:
    files: int
    chunks: int
    upserts: int
    deletes: int
    """Documents removed: on main, gone; on a branch, tombstones hiding main's."""
    reverts: int
    """Branch documents reverted to main's version."""
    graph_changes: int
    """Node and link deltas."""
    unchanged: int
    last_sequence: int | None
    """Stream sequence of the last delta published; None when nothing changed."""
    pending_through: int | None
    """When nothing changed: the stream sequence of the last delta an earlier ingest of the branch published (its
    manifest's ``published_through``), which the index may not hold yet; None otherwise, or when not recorded."""
    pending_from: int | None
    """And of the first delta that ingest published (``published_from``), when recorded."""
    main_pending_through: int | None
    """On a branch: the stream sequence of the last delta main's last ingest published (its ``published_through``),
    which the branch's queries read too; None on main, or when not recorded."""
    main_pending_from: int | None
    """And of the first delta that ingest published."""
    published: frozenset[int]
    """Stream sequences of every delta published."""
    keys_by_sequence: Mapping[int, str]
    """The manifest key of the delta published at each stream sequence (:meth:`Ingester.forget` takes them)."""
    too_large: list[str]
    """The symbol keys of documents not published: as JSON their delta is larger than the stream takes (text
    escaped six times over: control characters). Their manifest entries are unknown, so the next ingest tries them
    again."""
    embed_s: float
    publish_s: float
    exclusions: tuple[str, ...] = ()
    """This ingest's ``--exclude`` patterns, normalised."""
    exclusions_before: tuple[str, ...] | None = None
    """The ``--exclude`` patterns of the branch's previous ingest, when they differ from this one's (what they
    left out is published now, or what they kept deleted); None when they are the same, or not recorded."""
    main_exclusions: tuple[str, ...] | None = None
    """On a branch, main's last patterns when they differ from this ingest's: the difference shows as changes."""
    unparsed: tuple[str, ...] = ()
    """The files whose source could not be parsed, or was not for its size, each with why (``a.py (line 3:
    invalid syntax)``): indexed as whole files, without their symbols' or sections' chunks, calls or graph."""
    unread: tuple[str, ...] = ()
    """Files and directories that could not be read (access denied, a failing disk), relative to the tree: while
    there are any, the ingest deletes nothing."""
    main_never_ingested: bool = False
    """On a branch: main has no manifest, so every file of the tree is the branch's own, and none follows main."""
    package_of_main: str | None = None
    """On a branch: the package its modules were named after, main's, when the tree's directory has another name
    and no package was given."""
    package_from_imports: str | None = None
    """The package its modules were named after when that is not the tree's directory's name but the name its own
    files import it by (:func:`chunking.self_import_name`), no package given."""
    ignored: tuple[str, ...] = ()
    """The source files and directories (``dir/``) that ``.gitignore`` files left out, relative to the tree."""
    package: str | None = None
    """The package the modules were named after; None for none."""
    package_before: str | None = None
    """The package the branch's last ingest named the modules after ("" for none), when it is not this one's: every
    module was published again under its new name."""
    other_kinds: tuple[tuple[str, int], ...] = ()
    """Files of kinds this ingester does not read (:func:`file_kind`), that neither ``--exclude`` nor ``.gitignore``
    left out, counted by kind, the commonest first: an agent asking about them would otherwise find nothing unsaid
    (a tester's monorepo: 34 of 50 files, Go, TypeScript, YAML and SQL among them)."""

    raced: bool = False
    """Another ingest (or delete-branch) of the branch saved its manifest while this one published: their deltas
    interleaved, so the index holds a mix of the two; the keys they disagree on are recorded unknown, and the same
    command again makes the branch what it asks."""
    recorded: bool = True
    """Whether the branch had an ingest manifest at all (False: never ingested by an ingester of this project)."""

    @property
    def awaited_sequence(self) -> int | None:
        """The stream sequence the index must reach before the branch's content, as this ingest left it, is there:
        this ingest's last delta, or when it sent nothing an earlier ingest's (a retry of one whose wait timed out
        said it was done at once, the index still lacking its file: a tester's); on a branch that sent nothing,
        main's last ingest's too, whose documents the branch reads where it has none of its own (not when it sent
        some: main's recorded sequence may be of a stream made again since, and never come: a review's)."""
        if self.last_sequence is not None:  # after main's earlier deltas in the stream, whatever main recorded
            return self.last_sequence
        return max((s for s in (self.pending_through, self.main_pending_through) if s is not None), default=None)


class Ingester:
    def __init__(
        self,
        js: JetStreamContext,
        names: Names,
        embedder: Embedder | None,
        max_content_bytes: int,
        progress: Progress | None = None,
        cache: EmbeddingCache | None = None,
        token_vectors: bool = True,
        second: OnnxEmbedder | None = None,
        max_file_bytes: int = 0,
    ) -> None:
        """``max_file_bytes``: a larger file is read as one chunk (:func:`too_large`); 0, no limit."""
        self._js = js
        self._max_file_bytes = max_file_bytes
        self._token_vectors = token_vectors
        self._second = second
        self._names = names
        self._embedder = embedder
        self._max_content_bytes = max_content_bytes
        self._progress = progress or Silent()
        self._cache = cache
        self._manifests = ManifestStore(js, names)

    @property
    def _embedding_signature(self) -> str:
        if self._embedder is None:
            return "no-embedding"
        signature = self._embedder.vectors_name + ("+token-signs" if self._token_vectors else "")
        return signature + (f"+second:{self._second.name}" if self._second is not None else "")

    async def load_manifest(self, workspace: str, branch: str) -> Manifest:
        return _manifest_of(await self._manifests.load(workspace, branch))

    async def _save_manifest(
        self, workspace: str, branch: str, manifest: Manifest, loaded: StoredManifest
    ) -> StoredManifest:
        """``manifest`` saved over ``loaded`` (merged with what another ingest saved meanwhile); what was saved."""
        for _ in range(SAVE_ATTEMPTS):
            try:
                return await self._manifests.save(workspace, branch, manifest.to_json(), loaded)
            except ManifestChanged:
                # Another ingest of this branch published at the same time: their deltas and ours interleaved.
                loaded = await self._manifests.load(workspace, branch)
                manifest = manifest.merged_with(_manifest_of(loaded))
                log.warning("ingest_raced", workspace=workspace, branch=branch, unknown=manifest.unknown)
        raise ManifestChanged(f"{workspace}/{branch}: the manifest changed {SAVE_ATTEMPTS} times while saving")

    async def forget(self, workspace: str, branch: str, keys: Collection[str], held_or_not: bool = False) -> None:
        """Record ``keys`` unknown in the branch's manifest, so that the next ingest sends them again: their deltas
        were dead-lettered, and every ingest after called them unchanged (an ops tester's). Sent again, they are
        indexed if what refused them changed, or set aside again and said so. ``held_or_not``: also keys the
        manifest no longer holds (a revert's, whose row the branch still has: the next revert sends it again)."""
        if not keys:
            return
        loaded = await self._manifests.load(workspace, branch)
        manifest = _manifest_of(loaded)
        forgotten = {key: UNKNOWN for key in keys if held_or_not or key in manifest.entries}
        entries = {**manifest.entries, **forgotten}
        # Saved as an ingest saves: merged with another's saved meanwhile, the forgotten keys stay unknown.
        await self._save_manifest(workspace, branch, replace(manifest, entries=entries), loaded)

    async def ingest(
        self,
        root: Path,
        workspace: str,
        branch: str = MAIN_BRANCH,
        package: str | None = None,
        exclude: Collection[str] = (),
        allow_empty: bool = False,
        gitignore: bool = True,
    ) -> IngestReport:
        """Publish what changed in the tree at ``root`` since the last ingest of the workspace's branch.
        ``package``: the tree's package name when it is not its directory's (empty: none; see
        :func:`chunking.tree_package`). ``exclude``: paths left out (:func:`matches`); what an earlier ingest
        published of them is deleted, as for a file gone from the tree; so is what ``.gitignore`` files leave out,
        with ``gitignore`` (:class:`GitIgnores`). A tree with no source file that would
        delete documents is refused (EmptyTreeRefused) unless ``allow_empty``. When part of the tree could not be
        read (``IngestReport.unread``), nothing is deleted: what was not seen may still be there."""
        # One trace for the run: its deltas carry it to the projector's batches, which link to it.
        with tracer().start_as_current_span("ingest") as span:
            span.set_attribute("ontofabric.workspace", workspace)
            span.set_attribute("ontofabric.branch", branch)
            return await self._ingest(root, workspace, branch, package, exclude, allow_empty, gitignore)

    async def _ingest(
        self,
        root: Path,
        workspace: str,
        branch: str,
        package: str | None,
        exclude: Collection[str],
        allow_empty: bool,
        gitignore: bool,
    ) -> IngestReport:
        root = await asyncio.to_thread(root.resolve)  # its name may be the package's
        patterns = exclusion_patterns(root, exclude)
        unread: list[str] = []
        # No more of a file than could be indexed: over the size limit it is one chunk of its start. Twice the limit:
        # a file's size on disk is not its text's as UTF-8 (line ends of \r\n are read as \n), which the limit is of;
        # a file over twice it is over it as text too (a review's).
        max_read = 2 * max(self._max_file_bytes, self._max_content_bytes) + 1 if self._max_file_bytes else 0
        ignored: list[str] = []
        other_kinds: Counter[str] = Counter()
        sources = await asyncio.to_thread(read_tree, root, patterns, unread, max_read, gitignore, ignored, other_kinds)
        if (
            patterns
            and not sources
            and not unread
            and await asyncio.to_thread(lambda: any(discover(root, gitignore=gitignore)))
        ):
            # One word too many would delete the whole workspace's index.
            raise ExclusionRefused(
                f"--exclude {' '.join(patterns)} leaves out every source file of {root}: nothing sent"
            )
        main = await self.load_manifest(workspace, MAIN_BRANCH) if branch != MAIN_BRANCH else None
        named, package_of_main, package_from_imports = package, None, None
        package = own_package(root, named)
        is_package = await asyncio.to_thread((root / "__init__.py").is_file)
        if named is None:
            package_from_imports = await asyncio.to_thread(imported_package, root, sources)
            package = package_from_imports or package
        if named is None and is_package and main is not None and main.package and main.package != package:
            # A branch checked out in a directory of another name (a git worktree, `tenacity2`; `repo-feature`
            # names no package) named every module after it, or after none: every chunk sent again, every file
            # held whole (an outside tester's).
            package = package_of_main = main.package
            package_from_imports = None

        chunked, (graph_nodes, graph_links), defined_in = await self._read(root, sources, package)
        chunks = {c.document_id: c for c in chunked}
        nodes = {n.object_type: n for n in graph_nodes}
        links = {k.key: k for k in graph_links}
        graph_files = {f"n:{t}": defined_in[t] for t in nodes if t in defined_in}
        graph_files |= {
            f"l:{k}": defined_in[link.source_type] for k, link in links.items() if link.source_type in defined_in
        }
        # A document is sent again when its content changed or when what the embedder adds to it would differ
        # (another model or precision, token vectors or a second model switched on or off), so a rerun brings old
        # documents up to date. Names follow from the path and the content, but for a tree that is a package also
        # from its name: that goes in too (only then, so the manifests of other trees keep their values). So do the
        # calls a chunk makes, which another file's change can move (only when it makes some, for the same reason).
        suffix = f"|{package}" if package else ""
        signature = f"{self._embedding_signature}{suffix}"
        desired = {f"d:{i}": f"{c.content_hash}|{signature}{_derived_state(c)}" for i, c in chunks.items()}
        desired.update({f"n:{t}": node_hash(n) for t, n in nodes.items()})
        desired.update({f"l:{key}": "1" for key in links})
        loaded = await self._manifests.load(workspace, branch)
        previous = _manifest_of(loaded)
        patterns_changed = previous.exclude is not None and previous.exclude != patterns
        files = {f"d:{i}": c.file_path for i, c in chunks.items()}
        if unread:  # a directory not listed was left out, and its documents deleted (an ingest tester's)
            read = as_far_as_read(desired, previous, main)
            plan = without_removals(plan_ingest(read, previous, main, files, graph_files), previous)
        else:
            plan = plan_ingest(desired, previous, main, files, graph_files)
        # On a branch, what goes is main's documents hidden (deletes) and the branch's own taken back (reverts).
        gone = sum(1 for key in [*plan.deletes, *plan.reverts] if key.startswith("d:"))
        if not sources and gone and not allow_empty:
            raise EmptyTreeRefused(
                f"{root} holds no source file this ingester reads ({SOURCES_READ}): its ingest would "
                f"take {gone} documents out of {workspace}/{branch}. Nothing sent; check the path, or pass "
                "--allow-empty to empty the branch on purpose"
            )
        log.info(
            "ingest_planned", workspace=workspace, branch=branch, files=len(sources), chunks=len(chunks),
            upserts=len(plan.upserts), deletes=len(plan.deletes), reverts=len(plan.reverts),
        )  # fmt: skip

        documents = [chunks[k[2:]] for k in plan.upserts if k.startswith("d:")]
        embed_started = time.perf_counter()
        vectors = dict(zip([c.document_id for c in documents], await self._embed(documents), strict=True))
        embed_s = time.perf_counter() - embed_started
        model = self._embedder.model_name if self._embedder is not None else None

        def upsert(key: str) -> DeltaPayload:
            return _upsert(key, chunks, nodes, links, vectors, model, key in plan.whole_file)

        acks, keyed, too_large, publish_s, raced = await self._publish(
            workspace, branch, plan, upsert, loaded, previous, main, patterns, package or "", patterns_changed
        )
        changed = {*plan.upserts, *plan.reverts}
        return IngestReport(
            files=len(sources),
            chunks=len(chunks),
            upserts=len(documents) - sum(1 for key in too_large if key.startswith("d:")),  # those sent
            deletes=sum(1 for k in plan.deletes if k.startswith("d:")),
            reverts=sum(1 for k in plan.reverts if k.startswith("d:")),
            graph_changes=sum(1 for k in [*plan.upserts, *plan.deletes, *plan.reverts] if not k.startswith("d:")),
            # A chunk reverted to main's changed in the index too (a tester's: 27 reverts were also unchanged).
            unchanged=sum(1 for k in desired if k.startswith("d:") and k not in changed),
            last_sequence=max((a.seq for a in acks), default=None),
            # Nothing sent: the index may still lack what an earlier ingest sent (one whose wait timed out).
            pending_through=None if acks else previous.published_through,
            pending_from=None if acks else previous.published_from,
            main_pending_through=main.published_through if main is not None else None,
            main_pending_from=main.published_from if main is not None else None,
            published=frozenset(a.seq for a in acks),
            keys_by_sequence=dict(zip((a.seq for a in acks), (k for k in keyed if k not in too_large), strict=True)),
            too_large=[chunks[key[2:]].symbol_key for key in too_large if key.startswith("d:")],
            embed_s=embed_s,
            publish_s=publish_s,
            raced=raced,
            exclusions=patterns,
            unparsed=tuple(f"{c.file_path} ({c.parse_error})" for c in chunks.values() if c.parse_error is not None),
            unread=tuple(unread),
            package_of_main=package_of_main,
            package_from_imports=package_from_imports,
            ignored=tuple(ignored),
            other_kinds=tuple(sorted(other_kinds.items(), key=lambda kind: (-kind[1], kind[0]))),
            package=package or None,
            main_never_ingested=main is not None and not main.entries,
            exclusions_before=previous.exclude if patterns_changed else None,
            package_before=(
                previous.package
                if previous.entries and previous.package is not None and previous.package != (package or "")
                else None
            ),
            main_exclusions=(
                main.exclude if main is not None and main.exclude is not None and main.exclude != patterns else None
            ),
        )

    async def _publish(
        self,
        workspace: str,
        branch: str,
        plan: IngestPlan,
        upsert: Callable[[str], DeltaPayload],
        loaded: StoredManifest,
        previous: Manifest,
        main: Manifest | None,
        patterns: tuple[str, ...] | None,
        package: str | None,
        patterns_changed: bool,
    ) -> tuple[list[PubAck], dict[str, DeltaEnvelope], list[str], float, bool]:
        """``plan``'s deltas published (``upsert`` makes an upsert's payload) and the branch's manifest saved around
        them: the acknowledgements, the deltas by key, the keys too large to send, the seconds publishing took, and
        whether another ingest of the branch saved its manifest meanwhile (their deltas interleaved)."""
        base = loaded.generation + previous.digest + (main.digest if main is not None else "")

        def delta(key: str, change: str, payload: DeltaPayload) -> DeltaEnvelope:
            return envelope(workspace, payload, branch=branch, event_id=event_id(workspace, branch, base, key, change))

        keyed = {key: delta(key, plan.manifest.entries[key], upsert(key)) for key in plan.upserts}
        # A tombstone naming its file is another change than one naming none: two ingests racing from one
        # manifest gave both one event id, and the second was set aside as an id reused (a reviewer's).
        deleted_files = plan.deleted_files
        for key in plan.deletes:
            file = deleted_files.get(key)
            keyed[key] = delta(key, "deleted" if file is None else f"deleted|{file}", _removal(key, file))
        keyed |= {key: delta(key, "reverted", _removal(key, revert=True)) for key in plan.reverts}
        limit = min(MAX_DELTA_MESSAGE_BYTES, connection_of(self._js).max_payload) - DELTA_HEADER_ROOM_BYTES
        too_large = sorted(key for key, sent in keyed.items() if not fits(sent, limit))
        for key in too_large:
            log.warning("ingest_document_too_large", key=key, limit=limit)
        deltas = [sent for key, sent in keyed.items() if key not in too_large]
        unknown = dict.fromkeys(too_large, UNKNOWN)
        # The previous patterns until the ingest is done: one stopped part way says again that they changed.
        in_flight = Manifest(
            {**previous.entries, **dict.fromkeys(keyed, UNKNOWN)}, previous.exclude,
            {**previous.files, **plan.manifest.files}, previous.package, previous.published_through,
            previous.published_from,
        )  # fmt: skip
        if deltas:
            # Saved before publishing: an ingest stopped part way leaves every key it was sending unknown, so the
            # next one sends it again or removes it (before, what it had stored was nowhere, and stayed for good).
            loaded = await self._save_manifest(workspace, branch, in_flight, loaded)
        publish_started = time.perf_counter()
        self._progress.stage("publish", len(deltas))
        try:
            acks = await DeltaPublisher(self._js, self._names).publish_many(
                deltas, on_stored=lambda _: self._progress.advance("publish")
            )
        except PublishFailed as failed:
            if failed.stored:
                sent = [key for key in keyed if key not in too_large][: len(failed.stored)]
                failed.keys_by_sequence = dict(zip((a.seq for a in failed.stored), sent, strict=True))
                await self._record_stored(workspace, branch, plan, in_flight, loaded, failed)
            raise
        publish_s = time.perf_counter() - publish_started
        raced = False
        if deltas:
            done = Manifest(
                {**plan.manifest.entries, **unknown}, patterns, plan.manifest.files, package,
                max((a.seq for a in acks), default=previous.published_through),
                min((a.seq for a in acks), default=previous.published_from),
            )  # fmt: skip
            saved = _manifest_of(loaded)
            raced = saved.entries != in_flight.entries
            if raced:  # another ingest of the branch saved meanwhile: merged as a race
                done = done.merged_with(saved)
            final = await self._save_manifest(workspace, branch, done, loaded)
            raced = raced or _manifest_of(final).entries != done.entries
        elif (
            patterns_changed
            or _files_of_entries(plan.manifest.files, previous) != previous.files
            or previous.package != package
        ):
            # Nothing sent, but the patterns changed or the documents' files or the package were not recorded (a
            # manifest saved before they were, which a branch needs of main's): recorded if no other ingest saved
            # meanwhile.
            unchanged_manifest = Manifest(
                previous.entries, patterns, plan.manifest.files, package, previous.published_through,
                previous.published_from,
            )  # fmt: skip
            try:
                await self._manifests.save(workspace, branch, unchanged_manifest.to_json(), loaded)
            except ManifestChanged:  # merging would make the other ingest's keys unknown: its manifest stands
                log.info("ingest_manifest_not_recorded", workspace=workspace, branch=branch)
        return acks, keyed, too_large, publish_s, raced

    async def _record_stored(
        self,
        workspace: str,
        branch: str,
        plan: IngestPlan,
        in_flight: Manifest,
        loaded: StoredManifest,
        failed: PublishFailed,
    ) -> None:
        """A publish that failed part way: what it stored recorded as sent, so that the next ingest sends only the
        rest. Before, every key stayed unknown and the next one sent everything again under new event ids: an
        operator's delta stream, capped below one ingest, never took the whole of it, however often compacted."""
        entries = dict(in_flight.entries)
        for key in failed.keys_by_sequence.values():
            if key in plan.manifest.entries:
                entries[key] = plan.manifest.entries[key]
            else:  # a delete or a revert: the key leaves the manifest
                entries.pop(key, None)
        sequences = list(failed.keys_by_sequence)
        progress = replace(in_flight, entries=entries, published_through=max(sequences), published_from=min(sequences))
        try:
            await self._save_manifest(workspace, branch, progress, loaded)
        except (ManifestChanged, ManifestUnavailable) as error:  # the next ingest sends them again, as before
            failed.keys_by_sequence = {}
            log.warning("ingest_stored_not_recorded", workspace=workspace, branch=branch, error=str(error))

    async def revert_branch(self, workspace: str, branch: str) -> IngestReport:
        """Take back every change the branch's ingests made, so that it reads as main does: a revert for every
        entry of its manifest (documents, tombstones, graph nodes and links), and the manifest left empty. For a
        branch merged or given up: its rows stay only as the stream sequences that keep older deltas out."""
        if branch == MAIN_BRANCH:
            raise ValueError(f"{MAIN_BRANCH} has no main to read as: only a branch can be reverted")
        with tracer().start_as_current_span("branch revert") as span:
            span.set_attribute("ontofabric.workspace", workspace)
            span.set_attribute("ontofabric.branch", branch)
            main = await self.load_manifest(workspace, MAIN_BRANCH)
            loaded = await self._manifests.load(workspace, branch)
            previous = _manifest_of(loaded)
            plan = plan_ingest(main.entries, previous, main)  # the branch as main: nothing of its own
            assert not plan.upserts, plan.upserts
            assert not plan.deletes, plan.deletes

            def nothing_to_upsert(key: str) -> DeltaPayload:
                raise AssertionError(f"a revert upserts nothing, asked for {key}")

            acks: list[PubAck] = []
            keyed: dict[str, DeltaEnvelope] = {}
            too_large: list[str] = []
            publish_s, raced = 0.0, False
            if plan.reverts:  # else nothing of the branch's is left to take back, and no manifest is made for it
                # No patterns nor package recorded: the branch's next ingest starts afresh, not told they changed.
                acks, keyed, too_large, publish_s, raced = await self._publish(
                    workspace, branch, plan, nothing_to_upsert, loaded, previous, main, None, None, False
                )
        return IngestReport(
            files=0, chunks=0, upserts=0, deletes=0,
            reverts=sum(1 for k in plan.reverts if k.startswith("d:")),
            graph_changes=sum(1 for k in plan.reverts if not k.startswith("d:")),
            unchanged=0, last_sequence=max((a.seq for a in acks), default=None),
            pending_through=None if acks else previous.published_through,
            pending_from=None if acks else previous.published_from,
            main_pending_through=None, main_pending_from=None,
            published=frozenset(a.seq for a in acks),
            keys_by_sequence=dict(zip((a.seq for a in acks), (k for k in keyed if k not in too_large), strict=True)),
            too_large=[], embed_s=0.0, publish_s=publish_s, raced=raced, recorded=loaded.data is not None,
        )  # fmt: skip

    async def _read(
        self, root: Path, sources: Mapping[str, str], package: str | None
    ) -> tuple[list[Chunk], tuple[list[GraphNode], list[GraphLink]], dict[str, str]]:
        """:func:`read_sources` in a thread (parsing a tree takes seconds of CPU, and what shares this process's
        loop, the demo's projector and query worker, is not held up by it: it had been away past its lease), as the
        stage "read". Cancelled, the thread stops at its next file: a tester's Ctrl-C waited a minute for the
        reading to end, in silence."""
        steps, done, stop = reading_steps(sources), 0, threading.Event()
        self._progress.stage("read", steps)

        def tick() -> None:
            nonlocal done
            if stop.is_set():
                raise ReadingStopped
            done += 1
            self._progress.advance("read")

        try:
            read = await asyncio.to_thread(
                read_sources, root, sources, package, self._max_content_bytes, self._max_file_bytes, tick
            )
        except asyncio.CancelledError:
            stop.set()
            raise
        self._progress.advance("read", max(0, steps - done))  # files over the size limit are not parsed
        return read

    async def _embed(self, chunks: Sequence[Chunk]) -> list[ChunkEmbedding | None]:
        """Each chunk's vectors; none for a chunk with no text (an empty ``__init__.py``), whose vector was its
        name's alone and came first among the dense results for questions in its name's words (an agent tester's
        ``_pytest._py`` for "Pytester"): it is found by its name, its relations and keyword search."""
        if self._embedder is None:
            return [None] * len(chunks)
        embedder = self._embedder
        self._progress.stage("embed", len(chunks))
        texts = [c.embedding_text for c in chunks]
        written = [i for i in longest_first(texts) if chunks[i].content.strip()]
        embedded: list[ChunkEmbedding | None] = [None] * len(chunks)
        for start in range(0, len(written), EMBED_BATCH):
            still_wanted()  # an interrupt nats-py lost before (a stop tester's ingest embedded and published on)
            indexes = written[start : start + EMBED_BATCH]
            batch = [texts[i] for i in indexes]
            embed = self._cache.embed if self._cache is not None else embed_with_signs
            result = await asyncio.to_thread(embed, embedder, batch)
            if result.vectors.shape[1] != embedder.dimension:  # vectors from the cache, the model not loaded
                raise EmbedderMismatch(
                    f"{embedder.model_name}'s vectors have {result.vectors.shape[1]} dimensions; the deployment is "
                    f"set to {embedder.dimension} (ONTOFABRIC_EMBEDDING_DIM). Nothing was published"
                )
            second = await asyncio.to_thread(SecondVectors.of, self._second, batch, self._cache)
            made = ChunkEmbedding.of(result, embedder.dimension, self._token_vectors, second)
            for i, chunk_embedding in zip(indexes, made, strict=True):
                embedded[i] = chunk_embedding
            self._progress.advance("embed", len(batch))
        self._progress.advance("embed", len(chunks) - len(written))
        return embedded


def _link_of(key: str) -> OntologyLink:
    source, name, target = split_link_key(key)
    return OntologyLink(source_type=source, name=name, target_type=target)


def _upsert(
    key: str,
    chunks: Mapping[str, Chunk],
    nodes: Mapping[str, GraphNode],
    links: Mapping[str, GraphLink],
    vectors: Mapping[str, ChunkEmbedding | None],
    model: str | None,
    whole_file: bool,
) -> DeltaPayload:
    kind, name = key[0], key[2:]
    if kind == "d":
        return DocumentUpserted(document=to_document(chunks[name], vectors[name], model, whole_file=whole_file))
    if kind == "n":
        node = nodes[name]
        return NodeUpserted(
            node=OntologyNode(domain=node.domain, name=node.name, kind=node.kind, interfaces=list(node.interfaces))
        )
    return LinkAdded(link=_link_of(links[name].key))


def _files_of_entries(files: Mapping[str, str], manifest: Manifest) -> dict[str, str]:
    """``files`` of the keys ``manifest`` holds: what it records of them once saved (a key too large to send is
    in a plan's files but not in the manifest, which was saved again at every ingest: a reviewer's)."""
    return {key: path for key, path in files.items() if key in manifest.entries}


def _removal(key: str, deleted_file: str | None = None, revert: bool = False) -> DeltaPayload:
    kind, name = key[0], key[2:]
    if kind == "d":
        return (
            DocumentReverted(document_id=name)
            if revert
            else DocumentDeleted(document_id=name, deleted_file=deleted_file)
        )
    if kind == "n":
        return NodeReverted(object_type=name) if revert else NodeRemoved(object_type=name)
    return LinkReverted(link=_link_of(name)) if revert else LinkRemoved(link=_link_of(name))
