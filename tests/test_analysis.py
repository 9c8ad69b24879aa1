"""Code-aware analysis before PostgreSQL's parser."""

from __future__ import annotations

import time

import pytest

from ontofabric.shared.analysis import analyse, comparable, identifier_parts


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("writeBoolean(self, n)", "writeboolean write boolean(self, n)"),
        ("os.path.join(a)", "os.path.join os path join(a)"),
        ("getHTTPResponse", "gethttpresponse get http response"),
        ("read_file", "read_file read file"),
        ("base64", "base64 base 64"),
        ("low-density lipoprotein", "low density lowdensity lipoprotein"),
        # A hyphenated word's parts written together too: a query that writes it the other way finds it.
        ("GATA-3 and IL-6", "gata 3 gata3 and il 6 il6"),
        ("Ly-6C utf-8", "ly 6c ly6c utf 8 utf8"),
        ("e-mail, x-y-z; --flag a--b", "e mail email, x y z xyz; --flag a--b"),
        ("plain words stay", "plain words stay"),
        ("mRNA", "mrna"),
        # What a Unicode tester's spellings of one word did not find of each other (the parser, in the C locale,
        # lowercases ASCII only):
        ("Café CAFÉ café", "café café café"),
        ("Re\u0301sume\u0301 Résumé", "résumé résumé"),  # decomposed, as macOS writes names, and composed
        ("ＡＰＩ ﬁle", "api file"),  # full-width and ligature forms
        ("İstanbul Straße", "istanbul strasse"),
        ("\u200fretry\u200e soft\u00adhyphen zero\u200bwidth", "retry softhyphen zero width"),
        ("Über writeBoolean", "über writeboolean write boolean"),  # folded after identifiers are split by case
        ("préparer_café", "préparer_café préparer café"),  # a review's: it was cut at its accents
        # Punctuation and symbols past ASCII separate words, as ASCII's do: the parser takes them for letters (a
        # Unicode tester's "scheduler’s", “exponential” and rocketlaunch🚀 were words of their own).
        ("the scheduler’s “exponential” default—see", "the scheduler s  exponential  default see"),
        ("«retrait» „Wiederholung“ दुनिया। rocketlaunch🚀", " retrait   wiederholung  दुनिया  rocketlaunch "),
        ("a→b 37°C ±2 l·l", "a b 37 c  2 l l"),
        # A variation selector is no letter of the word after it, a keycap no letter of its digit's (a review's).
        ("⚠️Deprecated ✅Done 1️⃣step", " deprecated  done 1 step"),
        # A hyphen past ASCII is the hyphen, its parts written together too (a Unicode tester's well‐known).
        ("well\u2010known e\u2011mail", "well known wellknown e mail email"),
    ],
)
def test_analyse(text: str, expected: str) -> None:
    """As a document is read."""
    assert analyse(text, catenate=True) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("low-density lipoprotein", "low density lipoprotein"),
        ("GATA-3 and GATA3", "gata 3 and gata3"),
        ("writeBoolean(self, n)", "writeboolean write boolean(self, n)"),
    ],
)
def test_a_query_is_read_as_a_document_but_for_its_hyphenated_words_parts_written_together(
    text: str, expected: str
) -> None:
    """Catenated in documents only (as Lucene's word delimiter filter is set): a hyphenated query word would
    otherwise count twice, its parts and the whole (docs/quality.md, "Hyphenated words")."""
    assert analyse(text, catenate=False) == expected


def test_chinese_and_japanese_are_read_in_overlapping_pairs() -> None:
    """A run of them is one word to the parser: a Unicode tester's ``连接池`` did not find the docstring
    ``数据库连接池管理模块。``, only the whole sentence did."""
    assert comparable("数据库连接池管理模块。").split() == [
        "数据",
        "据库",
        "库连",
        "连接",
        "接池",
        "池管",
        "管理",
        "理模",
        "模块",
    ]  # the full stop a space, as punctuation past ASCII is
    assert set(analyse("连接池", catenate=False).split()) <= set(
        analyse("数据库连接池管理模块。负责创建和回收连接。", catenate=True).split()
    )
    assert analyse("インストール", catenate=False).split() == ["イン", "ンス", "スト", "トー", "ール"]
    assert comparable("plain ASCII, unchanged") == "plain ASCII, unchanged"
    assert set(analyse("佐々木", catenate=False).split()) <= set(
        analyse("佐々木さんの本を読んだ", catenate=True).split()
    )  # 々 is one of them


def test_identifier_parts_drop_single_characters() -> None:
    assert identifier_parts("x_y") == []
    assert identifier_parts("HTMLParser") == ["HTML", "Parser"]


def test_a_long_word_is_read_in_linear_time() -> None:
    """A review's: the hyphenated-word pattern took 123 s for one word of 100,000 characters (a hex blob, a data
    line), on the projector's event loop inside its transaction; read from each word's start only, milliseconds."""
    started = time.perf_counter()
    for catenate in (True, False):
        assert analyse("a" * 100_000 + "-b", catenate=catenate).startswith("a" * 100_000)
    assert time.perf_counter() - started < 2.0  # quadratic: minutes
