"""Exact identifiers (pure): a query that is a symbol's name or qualified name gets the chunks defining that symbol
first, whatever the retrievers made of it.

A name is one token to the keyword analyser and a word among others to the embedding, so a chunk that mentions
``RetryCallState`` ten times outranks the class that defines it (docs/quality.md, "Exact identifiers"). Matching
the stored ``symbolFqn`` does not guess: the query either is the symbol's name, or its last parts, or it is not.
The lookup itself is the document store's (``DocumentStore.definitions``).
"""

from __future__ import annotations

import ast
import bisect
import re
import textwrap
import unicodedata
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace

from ontofabric.contracts import SearchResult
from ontofabric.contracts.identifiers import CODE_DOLLAR, CODE_NAME_START, code_name, hyphenated_name, name_character
from ontofabric.services.ingest.chunking import DOCUMENT_FORMATS, assigned_by, at_level
from ontofabric.services.ingest.code import CODE_SUFFIXES, is_declaration_file, module_name
from ontofabric.shared.analysis import CHINESE_AND_JAPANESE

from .fusion import Fused, SourceHit
from .names import last_part, match_quality, qualities_kept
from .stages import above_the_rest

SYMBOL = "symbol"
"""The name a definition placed first goes by in ``foundBy``."""
CALLER, SUBCLASS, IMPORTER = "caller", "subclass", "importer"
CALLEE, BASE, IMPORTED = "callee", "base", "imported"
"""What a chunk placed first because it stands in the asked relation to the named symbol goes by in ``foundBy``:
what calls it, derives from it, imports it; what it calls, derives from, imports."""
RELATIONS = frozenset({CALLER, SUBCLASS, IMPORTER, CALLEE, BASE, IMPORTED})
FILE = "file"
"""What a chunk placed first because the query is its file's path goes by in ``foundBy``."""
MESSAGE = "message"
"""What a chunk placed first because its code writes the error or log message the query pastes goes by in
``foundBy`` (``messages.written_by``)."""
NAMED = frozenset({SYMBOL, FILE, MESSAGE})
"""What results placed first because the query names them go by (``_meta.exactSymbolMatches``)."""
PLACED_FIRST = RELATIONS | NAMED


def ranked_places(
    found_by: Iterable[Collection[str]], ranked_before: Sequence[int | None] | None = None
) -> list[int | None]:
    """Each result's place as the calibration reads it, from the retrievers that found each, in the answer's order:
    its place among the ranked results, None for one placed before them (a definition the query names, a chunk in
    the relation it asks about): those are no part of the order the fit saw, and counted as places they lowered
    every later result's score (a review's). ``ranked_before``, where the caller knows it: each result's index in
    the pipeline's order before anything was placed first (None for one the retrievers did not rank); one placed
    first that the retrievers ranked keeps its place there, so the results it was ranked above do not move up a
    place for being placed first (a tester's: a definition that was the retrievers' own first hit lifted the next
    result from place 2 to place 1, 0.34 to 0.63)."""
    found = list(found_by)
    before = list(ranked_before) if ranked_before is not None else [None] * len(found)
    placed_and_ranked = sorted(
        index
        for names, index in zip(found, before, strict=True)
        if not PLACED_FIRST.isdisjoint(names) and index is not None
    )
    places: list[int | None] = []
    ranked = 0
    for names, index in zip(found, before, strict=True):
        if PLACED_FIRST.isdisjoint(names):
            ranked += 1
            ahead = 0 if index is None else bisect.bisect_left(placed_and_ranked, index)
            places.append(ranked + ahead)
        else:
            places.append(None)
    return places


def places_of(results: Sequence[SearchResult]) -> list[int | None]:
    """:func:`ranked_places` of an answer's results, as the evaluations read them back: without the order before
    placing first, which a reply does not carry (only identifier and relation questions place any; the shared sets
    the calibration is fitted on ask none)."""
    return ranked_places({found.retriever for found in result.found_by} for result in results)


ASKED_RELATIONS = {
    "callers": CALLER,
    "callees": CALLEE,
    "subclasses": SUBCLASS,
    "bases": BASE,
    "importers": IMPORTER,
    "imports": IMPORTED,
}
"""OntologyQuery.relatedTo's relations -> what the chunks in them go by."""
RELATION_ASKED = {found_by: relation for relation, found_by in ASKED_RELATIONS.items()}
"""What chunks placed first for a relation go by -> the relation in relatedTo's words (``_meta.relation``)."""

CONSTRUCTORS = ("__init__", "__new__")
"""The methods a class's call runs: its callers are theirs too."""

MAX_IDENTIFIER_CHARS = 300
_KINDED = re.compile(
    r"(?:the\s+)?(?P<kind>class|def|async\s+def|function|method|module|package|interface|constant)\s+(?P<before>\S+)"
    r"|(?:the\s+)?(?P<after>\S+)\s+(?P<after_kind>class|function|method|module|package|interface|constant)",
    re.IGNORECASE,
)
"""A name with the kind of symbol it names, before or after it (an outside tester's ``class retry_base`` found the
class's docstring first, and its code not in the top 3). Taken as a name only where it reads as one, not as
words (:func:`_named_with_kind`)."""

_SEPARATOR = re.compile(r"::|#")
_CJK = re.compile(f"[{CHINESE_AND_JAPANESE}\uac00-\ud7af]")  # and Korean


def as_read(text: str) -> str:
    """The text as Python reads an identifier (NFKC: full-width `（）` and `：：` too), without the characters
    that show nothing (zero-width spaces and joiners, direction marks: Unicode's format characters): an agent
    tester's ``\u200f\u200bpass_context`` was no name, and another symbol came first at 0.9."""
    normal = unicodedata.normalize("NFKC", text)
    return "".join(c for c in normal if unicodedata.category(c) != "Cf") if not normal.isascii() else normal


def identifier_of(text: str, hyphens: bool = False) -> str | None:
    """The dotted name a query asks for when the whole query is one identifier: ``Retrying``,
    ``tenacity.retry.Retrying``, ``Retrying.__call__`` (also as ``Retrying::__call__`` or ``Retrying#__call__``), in
    backticks or with a call's ``()``; or asks where one is, or what it is, as a whole (:func:`_asked_for`:
    ``where is Console defined``, ``definition of Console``). None for any other text: other words around a name
    make it a question, not a name. ``hyphens``: also a name of :func:`hyphenated_name` (else only one dotted)."""
    written, _ = _asked(text)
    # Rust's `crate::` is the crate's root, which a declaration's path from it is an alias of (ingest.code).
    name = _SEPARATOR.sub(".", written.strip().strip("`").strip().removesuffix("()").removeprefix("crate::"))
    if len(name) > MAX_IDENTIFIER_CHARS or ("$" in name and not any(c.isalpha() or c == "_" for c in name)):
        return None  # `$`, `$$`: no name
    hyphenated = hyphenated_name().fullmatch(name) is not None and (hyphens or "." in name)
    return name if code_name().fullmatch(name) or hyphenated else None


# A hyphenated name is read where the query asks a relation (an agent tester's ``what imports
# nats-base-client.util`` ran as a search; ``what uses multi-threading`` is then asked of a name nothing defines, as
# ``what uses caching`` is), or where the whole query is a dotted name with a hyphen; ``well-known`` alone is none.


FILE_SUFFIXES = (".py", ".pyi", *DOCUMENT_FORMATS, *CODE_SUFFIXES)
"""What the files a path query can name end with: those an ingest reads, and a stub's."""
_PATH_PART = r"[^\s/`'\"<>|*?]+"
_FILE_PATH = re.compile(rf"(?:{_PATH_PART}/)*{_PATH_PART}(?:{'|'.join(map(re.escape, FILE_SUFFIXES))})")
_FRAMED_PATH = re.compile(rf"(?:[^/`'\"<>|*?\n]+/)*{_PATH_PART}(?:{'|'.join(map(re.escape, FILE_SUFFIXES))})")
"""A path as a traceback's frame quotes it: its directories may hold spaces; its file's name holds none."""
_FROM_ROOT = re.compile(r"(?:[A-Za-z]:)?/+|(?:\./)+")


_FRAME = re.compile(r'File\s+"(?P<path>[^"\n]+)",\s+line\s+(?P<line>\d{1,9})(?:,\s+in\s+(?P<name>\S+))?')
"""A traceback's frame as Python prints it: ``File "/x/rich/console.py", line 1697, in print``."""
_AT_LINE = re.compile(r"(?P<path>.+?)(?::|#L)(?P<line>\d{1,9})(?::\d{1,9})?")
"""A path with a line, as compilers, linters and code hosts write one: ``console.py:120``, ``console.py:120:8``,
``console.py#L120``."""


@dataclass(frozen=True)
class FileAsked:
    """The file a query is the path of (:func:`file_asked`), and the line and function it points at, if any."""

    path: str
    line: int | None = None
    name: str | None = None
    """The function a traceback's frame names (none for ``<module>``)."""


def file_asked(text: str) -> FileAsked | None:
    """The file (with its line, and a frame's function) when the whole query is one file's path
    (``rich/console.py``, ``./docs/index.md``, ``src\\pkg\\mod.py``, in backticks or quotes), a path with a line
    (``console.py:120``, ``console.py#L120``) or a traceback's frame (:data:`_FRAME`); the path without what leads
    to it from a root (``/``, ``./``, a drive). None for any other text. An agent tester's ``rich/console.py``
    found no chunk of that file first: it names no symbol."""
    text = as_read(text).strip()
    line, name, shape = None, None, _FILE_PATH
    if (frame := _FRAME.fullmatch(text)) is not None:
        # Python's own path: spaces in it are a directory's (`/Users/John Doe/...`), not words around a path.
        text, line, name, shape = frame.group("path"), int(frame.group("line")), frame.group("name"), _FRAMED_PATH
    elif (at := _AT_LINE.fullmatch(text.strip("`'\""))) is not None:
        text, line = at.group("path"), int(at.group("line"))
    path = text.strip().strip("`'\"").strip().replace("\\", "/")
    path = _FROM_ROOT.sub("", path, count=1) if _FROM_ROOT.match(path) else path
    if len(path) > MAX_IDENTIFIER_CHARS or not shape.fullmatch(path):
        return None
    return FileAsked(path, line, name if name is not None and code_name().fullmatch(name) else None)


@dataclass(frozen=True)
class FileChunk:
    """A chunk of a file a path query names, as the lookup read it (``DocumentStore.files``)."""

    id: str
    symbol_fqn: str
    file_path: str
    named: bool
    """Its symbol has the name a traceback's frame gives."""
    holds: bool
    """Its lines hold the line asked."""
    start: int | None


def pointed_into(chunks: Sequence[FileChunk], line: int | None, one_file: bool = True) -> list[FileChunk]:
    """The chunks of the first file among ``chunks`` (in the lookup's order, the best file first): a path names one
    file (a review's ``docs/README.md`` put the root README's sections first too, at 1.0); ``one_file`` False: of
    every file (a path several stored ones end with, none told apart). Of the chunks a frame's function names,
    those holding the line, or else the nearest to it alone: a file defining ``__init__`` in three classes had
    all three placed before the class holding the line."""
    if not chunks:
        return []
    files = [chunk for chunk in chunks if chunk.file_path == chunks[0].file_path or not one_file]
    named = [chunk for chunk in files if chunk.named]
    kept = [chunk for chunk in named if chunk.holds] or sorted(
        named, key=lambda chunk: abs((chunk.start or 0) - (line or 0))
    )[:1]
    return [chunk for chunk in files if not chunk.named or chunk in kept]


def kind_asked(text: str) -> str | None:
    """The kind of symbol a query that names one asks for (``def cell_len``, ``the print_json function``, ``class
    Console``): ``function``, ``method``, ``class`` or ``module`` (a symbolKind); None when it says none, or names
    no symbol (:func:`identifier_of`)."""
    return _asked(text)[1] if identifier_of(text) is not None else None


_KINDS_ASKED = {"def": "function", "async def": "function", "function": "function", "method": "method"}
_KINDS_ASKED |= {"class": "class", "interface": "class", "module": "module", "package": "module"}


def _asked(text: str) -> tuple[str, str | None]:
    """The text that names the symbol a query asks for, and the kind of symbol it says (a symbolKind)."""
    text = as_read(text)
    return _named_with_kind(text) or _asked_for(text) or (text, None)


def _asked_for(text: str) -> tuple[str, str | None] | None:
    """The name in a question asking for one symbol's definition as a whole (:data:`_DEFINITION_QUESTIONS`), as
    written, and the kind words around it say (``where is the Console class defined``). Only a name written as
    code writes one, or capitalised (:func:`code_shaped`), and kind words only where they read as a name's kind: a
    review's ``find errors``, ``what is the purpose``, ``what is the base class`` and ``where is the package
    manager`` were looked up as names, and a module called errors came first."""
    question = text.strip().rstrip("?.!").strip()
    for pattern in _DEFINITION_QUESTIONS:
        found = pattern.fullmatch(question)
        if found is None:
            continue
        asked, name = found.group("asked"), found.group("name")
        if _KINDED.fullmatch(asked.strip()):  # kind words: a name with its kind, or words
            return _named_with_kind(asked)
        bare = name.removesuffix("()")
        as_code = "`" in asked or name.endswith("()") or bool(_SEPARATOR.search(bare)) or code_shaped(bare)
        # Capitalised as a name is, in a question whose other words are not (`What Is The Purpose`: a second
        # review's title-cased questions were looked up as names); `I` is capitalised in any question, and a
        # question of two words (`Find Console`, `Where's Console`) cannot tell (a third review's).
        others = [w for w in (question[: found.start("asked")] + question[found.end("asked") :]).split() if w != "I"]
        sentence_case = len(others) <= 1 or (
            any(word[:1].islower() for word in others) and not any(word[:1].isupper() for word in others[1:])
        )
        if as_code or (bare[:1].isupper() and sentence_case):
            return name, None
    return None


def _named_with_kind(text: str) -> tuple[str, str | None] | None:
    """The name in ``class retry_base``, ``def wraps``, ``module tenacity.wait`` or ``the Retrying class``, and the
    kind (a symbolKind; None for ``constant``); None where the words read as words (a review's ``package manager``,
    ``base class``, ``class inheritance``): after ``def`` any name, after or before ``class`` a code-shaped or
    capitalised one, with the other kinds a code-shaped one."""
    kinded = _KINDED.fullmatch(text.strip())
    if kinded is None:
        return None
    name = kinded.group("before") or kinded.group("after")
    kind = " ".join((kinded.group("kind") or kinded.group("after_kind")).lower().split())
    bare = name.strip("`").removesuffix("()")
    if kind in ("def", "async def") and kinded.group("before"):
        return name, _KINDS_ASKED.get(kind)
    if code_shaped(bare) or (kind == "class" and bare[:1].isupper()):
        return name, _KINDS_ASKED.get(kind)
    return None


def code_shaped(name: str) -> bool:
    """Whether an identifier is written as only code writes one: with ``_``, ``.``, a digit, or a capital after its
    first letter (``DEFAULT_TIMEOUT``, ``httpx.Client``, ``utf8``, ``getValue``); a plain word (``pagination``,
    ``Retrying``) may be a question in one word, and so may a phrase of Chinese, Japanese or Korean, written
    without spaces, with a name or a number in it (``如何使用Redis缓存``: a review's)."""
    if any(c in "_." for c in name):
        return True
    if _CJK.search(name):
        return False
    return any(c.isdigit() for c in name) or any(c.isupper() for c in name[1:])


_NAME = rf"`?(?P<name>{CODE_NAME_START}(?:{name_character()}|{CODE_DOLLAR}|[.:#/-])*(?:\(\))?)`?"
_KIND = (
    r"(?:(?:async|abstract|base|generic|static)\s+)?(?:function|method|class|constructor|module|package|interface"
    r"|protocol|enum|struct|trait|type|decorator|coroutine|exception|dataclass|mixin|generator|property"
    r"|context\s+manager)"
)
"""What a question may call the symbol it names, before or after its name: an agent tester's ``who calls the async
context manager _start_hooks_context`` and ``which modules import the AckPolicy enum`` were searched in words."""
_THE = rf"(?:the\s+)?(?:(?P<kind_before>{_KIND})\s+)?{_NAME}(?:\s+(?P<kind_after>{_KIND}))?"
_PLAIN_KINDS = frozenset({"function", "method", "class", "constructor", "module", "package", "interface"})
"""The kinds a question names any symbol by (``the function retry``); by another (``the parser protocol``, ``the
exception handler``) the name is one only where code writes it so: :func:`_named_by_kind`."""
_ASKED = r"(?:what|who|which)(?:\s+\w+){0,2}?"  # what / which functions / what code in the package
_LISTED = r"(?:(?:find|list|show|get|(?:what|which)\s+(?:is|are))\s+)?(?:all\s+|the\s+)?"  # what are the bases of C
_THAT = r"(?:\s+(?:that|which))?"
RAISERS, RAISED = "raisers", "raised"
"""A question for what raises an exception (``what raises E``; ``E raised``, the name first): asked as its
callers, of a name written as code writes one."""
_RELATION_QUESTIONS = [
    (relation, re.compile(pattern, re.IGNORECASE))
    for relation, pattern in (
        # what calls f / who uses f / callers of f / where is f called / functions that call f / f callers
        (CALLER, rf"{_ASKED}\s+(?:calls?|invokes?|uses?|instantiates?)\s+{_THE}"),
        (CALLER, rf"{_LISTED}(?:callers|call\s+sites|usages|uses|invocations)\s+(?:of|to|for)\s+{_THE}"),
        (CALLER, rf"{_LISTED}calls\s+to\s+{_THE}"),
        (CALLER, rf"where\s+(?:is|are)\s+{_THE}\s+(?:called|used|invoked|instantiated)(?:\s+from)?"),
        (CALLER, rf"{_LISTED}(?:functions|methods|code){_THAT}\s+(?:calls?|invokes?|uses?)\s+{_THE}"),
        (CALLER, rf"{_THE}\s+(?:callers|call\s+sites|usages)"),
        # what raises E / where is E raised: raising an exception calls its class (raise E(...)), so its callers
        # (an exception's name as code writes one: `errors raised`, `what raises timeout` ask no lookup)
        (RAISERS, rf"{_ASKED}\s+(?:raises?|throws?)\s+{_THE}"),
        (RAISERS, rf"where\s+(?:is|are|does|do)\s+{_THE}\s+(?:get\s+)?(?:raised|thrown)(?:\s+from)?"),
        (RAISED, rf"{_THE}\s+(?:raised|thrown)"),
        # what subclasses C / which classes inherit from C / implementations of C / classes that extend C
        (SUBCLASS, rf"{_ASKED}\s+(?:subclass(?:es)?|extends?|inherits?\s+from|derives?\s+from|implements?)\s+{_THE}"),
        (
            SUBCLASS,
            rf"{_LISTED}(?:subclasses|subtypes|implementations|implementers|implementors|derived\s+classes)"
            rf"\s+(?:of|for)\s+{_THE}",
        ),
        (
            SUBCLASS,
            rf"{_LISTED}(?:classes|types){_THAT}\s+(?:subclass|extend|inherit\s+from|derive\s+from|implement)\s+{_THE}",
        ),
        (SUBCLASS, rf"{_THE}\s+(?:subclasses|subtypes|implementations)"),
        # what imports M / which modules import M / importers of M / where is M imported / M importers
        (IMPORTER, rf"{_ASKED}\s+imports?\s+{_THE}"),
        (IMPORTER, rf"{_LISTED}importers\s+of\s+{_THE}"),
        (IMPORTER, rf"where\s+(?:is|are)\s+{_THE}\s+imported(?:\s+from)?"),
        (IMPORTER, rf"{_LISTED}(?:modules|files){_THAT}\s+imports?\s+{_THE}"),
        (IMPORTER, rf"{_THE}\s+importers"),
        # the other direction: what does f call / callees of f / what is called by f
        (CALLEE, rf"{_ASKED}\s+(?:does|do)\s+{_THE}\s+(?:call|invoke)"),
        (CALLEE, rf"{_LISTED}(?:callees\s+(?:of|from|in)|calls\s+(?:made\s+by|from|in))\s+{_THE}"),
        (CALLEE, rf"what\s+(?:is|are)\s+(?:called|invoked)\s+(?:by|from|in)\s+{_THE}"),
        # what does C inherit from / base classes of C / what is C's superclass
        (BASE, rf"{_ASKED}\s+(?:does|do)\s+{_THE}\s+(?:inherit\s+from|derive\s+from|extend|subclass|implement)"),
        (
            BASE,
            rf"{_LISTED}(?:base\s+class(?:es)?|bases|superclass(?:es)?|parent\s+class(?:es)?|supertypes)"
            rf"\s+(?:of|for)\s+{_THE}",
        ),
        (
            BASE,
            rf"what\s+(?:is|are)\s+{_THE}'s\s+(?:base\s+class(?:es)?|bases|superclass(?:es)?|parent\s+class(?:es)?)",
        ),
        # what does M import / what is imported by M / dependencies of M
        (IMPORTED, rf"{_ASKED}\s+(?:does|do)\s+{_THE}\s+import"),
        (IMPORTED, rf"what\s+(?:is|are)\s+imported\s+(?:by|in|from)\s+{_THE}"),
        (IMPORTED, rf"{_LISTED}(?:imports|dependencies)\s+(?:of|in)\s+{_THE}"),
    )
]


_NOT_NAMES = frozenset({"from", "to", "by", "of", "in", "for", "with", "the", "a", "an", "it", "this", "that"})
"""Words a pattern can take for the name (``what does Foo import from``): no name."""

_ASKED_NAME = rf"(?P<asked>{_THE})"
_DEFINITION_QUESTIONS = [
    re.compile(pattern, re.IGNORECASE)
    for pattern in (
        # where is X (defined) / where's X / where does X live / where can I find X
        rf"where(?:\s+is|\s+are|'s)\s+{_ASKED_NAME}(?:\s+(?:defined|declared|implemented|located|assigned))?",
        rf"where\s+(?:does|do)\s+{_ASKED_NAME}\s+(?:live|come\s+from|get\s+defined)",
        rf"where\s+(?:can|do)\s+i\s+find\s+{_ASKED_NAME}",
        # find X / show me X / go to the definition of X / open the source of X
        rf"(?:find|locate|show(?:\s+me)?|open|go\s+to|jump\s+to|look\s+up)\s+(?:the\s+)?"
        rf"(?:(?:definition|declaration|implementation|source(?:\s+code)?|code)\s+(?:of|for)\s+)?{_ASKED_NAME}",
        # definition of X / X definition / X's source
        rf"(?:the\s+)?(?:definition|declaration|implementation|source(?:\s+code)?)\s+(?:of|for)\s+{_ASKED_NAME}",
        rf"{_ASKED_NAME}(?:'s)?\s+(?:definition|declaration|implementation|source(?:\s+code)?)",
        # what is X / how is X implemented / how does X work
        rf"what(?:\s+is|\s+are|'s)\s+{_ASKED_NAME}",
        rf"how\s+(?:is|are)\s+{_ASKED_NAME}\s+(?:implemented|defined|written)",
        rf"how\s+(?:does|do)\s+{_ASKED_NAME}\s+work",
    )
]
"""Questions asking for one named symbol as a whole: an agent tester's ``where is Console defined`` ran no name
lookup, and rich's ``Console`` was not in the top 10 (``Console`` alone: first). Any other words make it a
question that search answers (``where is the retry loop defined`` names no symbol)."""


def _exception_shaped(name: str, first_word: bool) -> bool:
    """A name as code writes an exception's: code-shaped, or capitalised (``Unreachable``); as the query's first
    word, where a sentence capitalises any, as a class is (``WebSocketDisconnect``, ``TimeoutError``), not
    ``Errors raised``, ``Nothing raised`` (a review's)."""
    last = name.rsplit(".", 1)[-1].lstrip("_")
    if code_shaped(name) or not last[:1].isupper():
        return code_shaped(name)
    return not first_word or sum(char.isupper() for char in last) > 1 or last.endswith(_EXCEPTION_ENDINGS)


_EXCEPTION_ENDINGS = ("Error", "Exception", "Warning", "Exit", "Interrupt", "Timeout", "Failure", "Fault")


def relation_of(text: str) -> tuple[str, str] | None:
    """(what the asked-for chunks are to the symbol: one of ``RELATIONS``; the symbol's dotted name) when the whole
    query asks that about one identifier: ``what calls to_seconds``, ``callers of `wait_base` ``, ``which classes
    inherit from wait_base``, ``what imports tenacity._utils``; ``what does wraps call``, ``base classes of
    Retrying``, ``what does tenacity.wait import``. None for any other text (a question that also asks something
    else is no lookup)."""
    question = as_read(text).strip().rstrip("?.!").strip()
    for relation, pattern in _RELATION_QUESTIONS:
        found = pattern.fullmatch(question)
        # A file's path where imports are asked (`_compat.py` is the file, not a module `py` of a package `_compat`).
        as_path = (
            _module_of_path(found.group("name")) if found is not None and relation in (IMPORTER, IMPORTED) else None
        )
        name = as_path or (identifier_of(found.group("name"), hyphens=True) if found is not None else None)
        if name is not None and relation in (RAISERS, RAISED) and not _exception_shaped(name, relation == RAISED):
            continue
        if name is not None and not as_path and not _named_by_kind(found, name):
            continue
        if name is not None and name.lower() not in _NOT_NAMES:
            return (CALLER if relation in (RAISERS, RAISED) else relation), name
    return None


def _named_by_kind(found: re.Match[str] | None, name: str) -> bool:
    """Whether a name the question calls by a kind is one: by a kind of :data:`_PLAIN_KINDS` (``the async function
    fetch``, ``the base class handler``: a review's), or none, any; by another, one code writes so, capitalised or
    in backticks (``the AckPolicy enum``, ``the async context manager _start_hooks_context``), not a word (a
    retest's "what implements the parser protocol" and "who calls the exception handler" were asked of ``parser``
    and ``handler``)."""
    said = (found.groupdict().get("kind_before") or found.groupdict().get("kind_after")) if found else None
    if found is None or said is None:
        return True
    kind = said.lower().split()[-1]  # "async function", "static method", "base class": the kind is the last word
    quoted = found.start("name") > 0 and found.string[found.start("name") - 1] == "`"  # `parser`: code
    return kind in _PLAIN_KINDS or quoted or code_shaped(name) or name[:1].isupper()


def _module_of_path(path: str) -> str | None:
    """The module a source file's path names, as an ingest names it (``src/clock.rs`` is ``src.clock``,
    ``pkg/__init__.py`` is ``pkg``): what importers are asked of (an agent tester's ``what imports src/clock.rs``
    was searched for in words). None for what is no such path."""
    if not path.endswith((".py", ".pyi", *CODE_SUFFIXES)) or not _FILE_PATH.fullmatch(path):
        return None
    module = module_name(path).removesuffix(".__init__")
    return module if hyphenated_name().fullmatch(module) else None


PARSED_FOR_LINES_CHARS = 100_000
"""Content up to this long is parsed to find where it assigns a name (a few milliseconds); longer, or not
parsable (cut), it is searched line by line."""


def assignment_line(content: str, name: str, start_line: int, top_only: bool = False) -> int | None:
    """The line of the file (``start_line``: the content's first) where ``content`` assigns ``name``, at the
    shallowest level that does (a module's, then its classes'; ``if`` and ``try`` blocks count as their level):
    a module's constant, a class's attribute, which have no chunk of their own. None when it does not. ``top_only``:
    at the content's own level alone (a class's ``mark`` attribute is not the module's ``mark``)."""
    if len(content) <= PARSED_FOR_LINES_CHARS:
        try:
            tree = ast.parse(textwrap.dedent(content))
        except (SyntaxError, ValueError, RecursionError, MemoryError):
            pass
        else:
            line = _assigned_at(tree.body, name, top_only)
            return None if line is None else start_line + line - 1
    assigning = re.compile(rf"^([ \t]*)(?:[^\W\d]\w*[ \t]*=[ \t]*)*{re.escape(name)}[ \t]*(?::[^=\n]*)?=(?!=)", re.M)
    found = min(assigning.finditer(content), key=lambda m: (len(m.group(1)), m.start()), default=None)
    if found is None or (top_only and found.group(1)):
        return None
    return start_line + content.count("\n", 0, found.start())


def _assigned_at(body: list[ast.stmt], name: str, top_only: bool = False) -> int | None:
    """The first line of ``body``'s level assigning ``name`` (``A = ...``, ``A: T``, ``x, A = ...``), else (unless
    ``top_only``) of its classes' bodies, level by level."""
    level = body
    while level:
        statements = at_level(level)
        for statement in statements:
            if name in assigned_by(statement):
                return statement.lineno
        level = [] if top_only else [inner for s in statements if isinstance(s, ast.ClassDef) for inner in s.body]
    return None


LINES_FOUND_PER_ANSWER = 5
"""At most this many results of an answer are read for the line assigning the name (a parse each, up to tens of
milliseconds: a name many modules assign, ``logger``, would have had all its chunks parsed, a review's)."""


def with_assignment_lines(
    results: Sequence[SearchResult],
    assigning: Collection[str],
    name: str,
    contents: Mapping[str, str],
    publishing: Collection[str] = frozenset(),
) -> list[SearchResult]:
    """Each of the first :data:`LINES_FOUND_PER_ANSWER` results found by symbol as the chunk assigning ``name``
    (``assigning``: their ids) with the line where it does (:func:`assignment_line`; ``publishing``: those assigning
    it at their own level alone, :attr:`Definitions.publishing`): an agent tester's ``FILTERS`` was answered by a
    module of 1,873 lines, cut before the line that assigns it, with nothing saying where."""
    placed, read = [], 0
    for result in results:
        start = result.metadata.get("startLine")
        found = result.id in assigning and any(f.retriever == SYMBOL for f in result.found_by)
        if found and isinstance(start, int) and read < LINES_FOUND_PER_ANSWER:
            read += 1
            line = assignment_line(contents[result.id], last_part(name), start, result.id in publishing)
            result = result.model_copy(update={"assigned_at_line": line}) if line is not None else result
        placed.append(result)
    return placed


def definitions_first(
    name: str,
    definitions: Mapping[str, str],
    candidates: Sequence[Fused],
    limit: int,
    modules: Collection[str] = frozenset(),
    kind: str | None = None,
    kinds: Mapping[str, str] | None = None,
    files: Mapping[str, str] | None = None,
    published: Collection[str] = frozenset(),
    assigning: Collection[str] = frozenset(),
) -> list[Fused]:
    """The chunks whose qualified name matches ``name`` (``definitions``: id -> symbolFqn, as looked up), at most
    ``limit``, ahead of the other candidates, each scoring 1 and found by ``symbol`` besides what found it before.
    Matches ignoring case count only when none matches as written. Among themselves: the better match first, then
    those of the ``kind`` of symbol asked (``kinds``: id -> symbolKind; an agent tester's ``def cell_len`` got a
    property first, the function second), then what defines it before what assigns it (``assigning``: an agent
    tester's `command` had click's class `Context`, annotating `command: Command`, before the method
    `Group.command`), then classes and functions before modules (``modules``: ids of whole
    files; a module would hold, and so hide, its function of the same name), then code before the declaration
    file of its module (``files``: id -> filePath; an agent tester's every lookup in a published package had the
    `.d.ts` signature first, its code second), then what its package publishes (``published``: ids of chunks
    re-exported under another name; an agent tester's ``sleep`` had a backend's method ahead of ``anyio.sleep``),
    then the order the pipeline gave them, then the shorter name. The other candidates keep their order and
    scores. Unchanged when nothing matches."""
    in_file = files or {}
    position = {hit.id: i for i, hit in enumerate(candidates)}
    of_kind = kinds or {}
    matched = sorted(
        (
            quality,
            kind is not None and of_kind.get(doc_id) != kind,
            doc_id in assigning,
            doc_id in modules,
            is_declaration_file(in_file.get(doc_id, "")),
            doc_id not in published,
            position.get(doc_id, len(candidates)),
            len(fqn),
            fqn,
            doc_id,
        )
        for doc_id, fqn in definitions.items()
        if (quality := match_quality(fqn, name)) is not None
    )
    if not matched:
        return list(candidates)
    kept = qualities_kept(matched[0][0], name)  # as written, those ignoring case are other symbols
    matched = [m for m in matched if m[0] in kept]
    return _placed_first([doc_id for *_, doc_id in matched[:limit]], candidates, SYMBOL)


def related_first(
    related: Mapping[str, str],
    candidates: Sequence[Fused],
    limit: int,
    found_by: str,
    modules: Collection[str] = frozenset(),
    distances: Mapping[str, int] | None = None,
) -> list[Fused]:
    """The chunks standing in the asked relation to the named symbol (``related``: id -> symbolFqn or object type;
    ``found_by``: one of ``RELATIONS``), at most ``limit``, ahead of the other candidates, each scoring 1 and
    found by ``found_by`` besides what found it before: the nearer first (``distances``: a subclass before its own
    subclasses), then functions and classes before a module's own statements (``modules``), then the order the
    pipeline gave them, then by name. The other candidates keep their order and scores."""
    position = {hit.id: i for i, hit in enumerate(candidates)}
    distance = distances or {}

    def order(doc_id: str) -> tuple[int, bool, int, str, str]:
        return (
            distance.get(doc_id, 0),
            doc_id in modules,
            position.get(doc_id, len(candidates)),
            related[doc_id],
            doc_id,
        )

    return _placed_first(sorted(related, key=order)[:limit], candidates, found_by)


def _placed_first(ids: Sequence[str], candidates: Sequence[Fused], found_by: str) -> list[Fused]:
    existing = {hit.id: hit for hit in candidates}
    first = []
    for rank, doc_id in enumerate(ids, start=1):
        hit = existing.get(doc_id) or Fused(doc_id, 0.0, 1.0)
        first.append(replace(hit, relevance=1.0, found_by={**hit.found_by, found_by: SourceHit(rank, 1.0)}))
    return above_the_rest(first, candidates)
