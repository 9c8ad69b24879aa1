"""Code-aware text analysis applied before PostgreSQL's text search parser, to documents and queries alike.

PostgreSQL keeps ``writeBoolean``, ``base64`` and ``os.path.join`` as single tokens, and ``low-density`` as a
compound beside its parts. Code search needs the parts of identifiers: each compound identifier is kept and
followed by its parts, so an exact identifier still matches as a whole and ``write boolean`` finds it as well
(``read_file``, which the parser splits itself, gets its parts once more, which weighs identifier words up).
Hyphens between word characters become spaces; in a document, a hyphenated word is also followed by its parts
written together (``GATA-3`` -> ``GATA 3 GATA3``, ``e-mail`` -> ``e mail email``), so that a query writing the word
without its hyphen finds it (``GATA3``, ``email``). Queries are not catenated, as Lucene's word delimiter filter is
set to catenate at index time only: a hyphenated query word would otherwise count twice, as its parts and whole
(measured both ways: docs/quality.md, "Hyphenated words"). Lexemes of one character are dropped in SQL
(``index_tsvector`` in the migrations).

Text other than ASCII is made comparable first (:func:`comparable`): PostgreSQL's parser, in the C locale the
embedded server runs, lowercases ASCII only, takes a run of Chinese or Japanese characters for one word, and
compares code points, so a Unicode tester's ``Café`` did not find ``café``, a decomposed ``Résumé`` (as macOS
writes names) not the composed one, ``ＡＰＩ`` not ``API``, a word with an invisible mark in it not the word, and
``连接池`` not the sentence it stands in.
"""

from __future__ import annotations

import functools
import re
import unicodedata

from ontofabric.contracts.identifiers import character_ranges, identifier

_PART = re.compile(r"[A-Z]+(?=[A-Z][a-z])|[A-Z]?[a-z]+|[A-Z]+|[0-9]+")
_HYPHENATED = re.compile(r"(?<!\w)\w+(?:-\w+)+")
"""A hyphenated word, matched from its start only: without the look-behind a long word with no hyphen was tried
again from each of its characters, each try reading to its end (a review's: 123 s for 100,000 characters)."""
_INVISIBLE = re.compile(
    "[\u00ad\u061c\u180e\u200c-\u200f\u202a-\u202e\u2060-\u2064\u2066-\u206f\ufe00-\ufe0f\ufeff\U000e0100-\U000e01ef]"
)
"""Format characters that change no word (soft hyphen, joiners, direction marks, the byte-order mark) and variation
selectors (``⚠️``'s, a review's: it stuck to the word after its emoji): removed. The zero-width space separates
words: it becomes a space."""
CHINESE_AND_JAPANESE = (
    "\u3005-\u3007\u3040-\u30ff\u31f0-\u31ff\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff\U00020000-\U0002fa1f"
)
"""Han ideographs, hiragana and katakana, written without spaces between words, with the marks written among them
(々 as in 佐々木: a review's), as ranges of a regular expression's character class."""
_CJK_RUN = re.compile(f"[{CHINESE_AND_JAPANESE}]{{2,}}")


@functools.cache
def _separating() -> re.Pattern[str]:
    """Punctuation and symbols past ASCII (``’ “ ” — « » „ । 。``, emoji, and the enclosing marks of ``1️⃣``): a
    space between words. PostgreSQL's parser in the C locale takes every character past ASCII for a letter, so a
    Unicode tester's ``scheduler’s``,
    ``“exponential”`` and ``rocketlaunch🚀`` were words of their own, and ``scheduler``, ``exponential`` and
    ``rocketlaunch`` found nothing. Read from the Unicode database this Python has, up to the emoji's plane (the
    planes past it hold ideographs, tags and private use), once per process."""
    categories = (unicodedata.category(chr(code)) for code in range(0x80, 0x20000))
    separating = (code for code, category in enumerate(categories, 0x80) if category[0] in "PS" or category == "Me")
    return re.compile(f"[{character_ranges(separating)}]")


def identifier_parts(identifier: str) -> list[str]:
    """``getHTTPResponse`` -> [get, HTTP, Response]; ``os.path.join`` -> [os, path, join]; parts of 2+ chars. A
    piece between ``.`` and ``_`` with letters other than ASCII is a part as it is (``préparer_café`` -> [préparer,
    café]): its case is not split."""
    parts: list[str] = []
    for piece in re.split(r"[._]+", identifier):
        parts.extend(p for p in (_PART.findall(piece) if piece.isascii() else [piece]) if len(p) > 1)
    return parts


def expand_identifiers(text: str) -> str:
    """``text`` with the parts of every compound identifier appended after it."""

    def expand(match: re.Match[str]) -> str:
        token = match.group(0)
        parts = identifier_parts(token)
        return f"{token} {' '.join(parts)}" if len(parts) > 1 else token

    return (_ASCII_IDENTIFIER if text.isascii() else identifier()).sub(expand, text)


_ASCII_IDENTIFIER = re.compile(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*", re.ASCII)
""":func:`identifier` within ASCII text, where its large class of characters past ASCII only costs time (a sixth of
the analysis of a source file)."""


def compound_identifiers(text: str) -> tuple[str, str]:
    """A query's compound identifiers whole, and their parts, each as :func:`analyse` writes them
    (``getFreePort`` -> ``getfreeport``, ``get free port``). A whole word that no document holds, and that is no
    part, stands for its parts: it is not missing from the query, its parts are (a quality tester's
    ``jsonPrettyDump``, a word in no document, scored a third of what ``json_pretty_dump`` did for the same
    answer)."""
    compounds = [
        match.group(0)
        for match in identifier().finditer(_HYPHENATED.sub(_parts, comparable(text)))
        if len(identifier_parts(match.group(0))) > 1
    ]
    parts = [part for compound in compounds for part in identifier_parts(compound)]
    return folded(" ".join(compounds)), folded(" ".join(parts))


def _bigrams(match: re.Match[str]) -> str:
    run = match.group(0)
    return " " + " ".join(run[i : i + 2] for i in range(len(run) - 1)) + " "


def comparable(text: str) -> str:
    """``text`` in the form two spellings of the same words share: compatibility-normalised (NFKC, as Python
    reads identifiers: composed accents, full-width and ligature forms as their plain letters), invisible format
    characters removed, punctuation and symbols past ASCII spaces (:func:`_separating`), and each run of Chinese
    or Japanese characters as its overlapping pairs (``数据库`` -> ``数据 据库``, as Lucene's CJK analysis indexes
    them: a word of that writing found within a sentence). ASCII text is returned as it is."""
    if text.isascii():
        return text
    text = _INVISIBLE.sub("", unicodedata.normalize("NFKC", text).replace("\u200b", " "))
    # A hyphen past ASCII (NFKC makes the non-breaking one it too) is the ASCII hyphen, whose words are also written
    # together (a Unicode tester's well‐known was not found by wellknown), not a separator as other dashes are.
    return _CJK_RUN.sub(_bigrams, _separating().sub(" ", text.replace("\u2010", "-")))


def folded(text: str) -> str:
    """``text`` case-folded as Unicode folds it (``Straße`` -> ``strasse``), a dotted capital I as ``i``."""
    return text.lower() if text.isascii() else text.casefold().replace("i\u0307", "i")


def _parts(match: re.Match[str]) -> str:
    return match.group(0).replace("-", " ")


def _parts_and_catenated(match: re.Match[str]) -> str:
    parts = match.group(0).split("-")
    return f"{' '.join(parts)} {''.join(parts)}"


def analyse(text: str, *, catenate: bool) -> str:
    """The text the keyword index (and a keyword query) is built from: comparable, hyphenated words as their parts
    (a document's also with its parts written together: ``catenate``), identifiers expanded (which reads their
    case), then case-folded."""
    hyphenated = _parts_and_catenated if catenate else _parts
    return folded(expand_identifiers(_HYPHENATED.sub(hyphenated, comparable(text))))
