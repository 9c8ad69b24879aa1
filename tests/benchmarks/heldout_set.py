"""Held-out BEIR-layout sets built from what this machine has, for checking that retrieval defaults tuned on
../shared/eval carry over to data they were not tuned on. In all but ``stdlib-modules`` each query has exactly one
relevant document.

- ``stdlib``: every module- or class-level function of this Python's standard library that has a docstring
  becomes a document, its source with the docstring cut out; the docstring's first sentence is the query
  (CodeSearchNet's recipe, Husain et al. 2019). The same Python version and distribution give the same set.
- ``stdlib-long``: the same, for functions whose whole docstring has at least 40 words, and the whole docstring
  is the query: long queries that repeat what matters to them, as ArguAna's arguments do.
- ``man``: every manual page (sections 1-8, English) becomes a document, its text without the NAME section; the
  one-line description from NAME is the query. Which pages there are depends on the packages installed.
- ``stdlib-modules``: the opposite shape, many answers to a query. The documents are the same functions (whatever
  their docstring's length; those whose code repeats another's left out); the query is the first sentence of a
  module's docstring ("Generic (shallow and deep) copying operations."), and every function of that module is
  relevant. Modules with fewer than three functions, no docstring, or a first sentence under three words are left
  out. Topic queries with many answers, as TREC-COVID's or NFCorpus's are.

In the one-answer sets, items whose query or text repeats another's are left out, so no query has two
answers. The samples are seeded.

Run: .venv/bin/python tests/benchmarks/heldout_set.py {stdlib,stdlib-long,stdlib-modules,man} OUT_DIR
[--documents N] [--queries N]
then: .venv/bin/ontofabric eval OUT_DIR --split test
"""

from __future__ import annotations

import argparse
import ast
import gzip
import random
import re
import sysconfig
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from ontofabric.services.ops.beir import BeirDataset, write_beir

# Test suites, demos and vendored copies would add near-duplicates of the code they exercise.
_SKIP_PARTS = {"test", "tests", "idle_test", "idlelib", "lib2to3", "site-packages", "ensurepip", "turtledemo"}
_SENTENCE = re.compile(r"^(.+?[.!?])(?:\s|$)", re.DOTALL)


def first_sentence(docstring: str) -> str:
    paragraph = docstring.strip().split("\n\n")[0]
    match = _SENTENCE.match(paragraph)
    return " ".join((match.group(1) if match else paragraph).split())


def without_docstring(source: str, node: ast.FunctionDef | ast.AsyncFunctionDef) -> str:
    """The function's source lines, decorators included, minus those of its docstring."""
    lines = source.splitlines()
    start = min([node.lineno, *(d.lineno for d in node.decorator_list)])
    doc = node.body[0]
    kept = lines[start - 1 : doc.lineno - 1] + lines[doc.end_lineno or doc.lineno : node.end_lineno]
    indent = min((len(line) - len(line.lstrip()) for line in kept if line.strip()), default=0)
    return "\n".join(line[indent:] for line in kept).strip()


def module_and_class_functions(tree: ast.Module) -> list[ast.FunctionDef | ast.AsyncFunctionDef]:
    """Functions at module level and in classes, not those nested in a function: the enclosing function's source
    holds a nested one's docstring, which would make its query match two documents."""
    found: list[ast.FunctionDef | ast.AsyncFunctionDef] = []
    bodies = [tree.body]
    while bodies:
        for node in bodies.pop():
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                found.append(node)
            elif isinstance(node, ast.ClassDef):
                bodies.append(node.body)
    return found


def whole_docstring(docstring: str) -> str:
    return " ".join(docstring.split())


def stdlib_functions(query_of: Callable[[str], str] = first_sentence, min_words: int = 4) -> list[tuple[str, str, str]]:
    """(id, query, code) for every documented function of the standard library, in path order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    found = []
    for path in sorted(root.rglob("*.py")):
        if _SKIP_PARTS & set(path.relative_to(root).parts):
            continue
        try:
            source = path.read_text(encoding="utf-8")
            tree = ast.parse(source)
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        module = ".".join(path.relative_to(root).with_suffix("").parts)
        for node in module_and_class_functions(tree):
            docstring = ast.get_docstring(node)
            if not docstring or len(node.body) < 2:
                continue
            query = query_of(docstring)
            code = without_docstring(source, node)
            if len(query.split()) >= min_words and code.count("\n") >= 2:
                found.append((f"{module}:{node.name}:{node.lineno}", query, code))
    return found


_ROFF_APOSTROPHE = re.compile(r"\\\*\(Aq|\\\(aq|\\'")
_ROFF_ESCAPE = re.compile(r"\\(f[BIRP1-4]|f\(..|f\[[^]]*\]|s[-+]?\d|\*?\(..|\*?\[[^]]*\]|\*.|[&|^/,:%])")
_ROFF_ARGUMENTS = {".B", ".I", ".BR", ".RB", ".BI", ".IB", ".IR", ".RI", ".SM", ".SB", ".SH", ".SS", ".TP", ".IP"}


def roff_text(line: str) -> str:
    """One line of a manual page's source as plain text: font and spacing escapes dropped, macro names too."""
    if line.startswith((".", "'")):
        macro, _, rest = line.partition(" ")
        if macro not in _ROFF_ARGUMENTS:
            return ""
        line = rest.replace('"', "")
    line = _ROFF_ESCAPE.sub("", _ROFF_APOSTROPHE.sub("'", line)).replace("\\-", "-").replace("\\e", "\\")
    return line.strip()


def without_definitions(lines: list[str]) -> list[str]:
    """Lines outside macro definitions and ignored blocks (``.de``/``.ig`` up to ``..``): their bodies are no text."""
    kept, inside = [], False
    for line in lines:
        if line.startswith((".de", ".ig", ".am")):
            inside = True
        elif inside and line.startswith(".."):
            inside = False
        elif not inside:
            kept.append(line)
    return kept


def manual_pages(root: Path = Path("/usr/share/man"), max_chars: int = 20_000) -> list[tuple[str, str, str]]:
    """(id, description, text) for every English manual page with a NAME line ``name \\- description``."""
    found = []
    for path in sorted(root.glob("man[1-8]/*.gz")):
        if path.name.startswith("gcloud"):  # thousands of pages that differ in one word of their command line
            continue
        try:
            source = gzip.decompress(path.read_bytes()).decode("utf-8", errors="replace")
        except (OSError, EOFError):
            continue
        lines = without_definitions(source.splitlines())
        headings = [n for n, line in enumerate(lines) if line.upper().startswith((".SH NAME", '.SH "NAME"'))]
        if not headings or lines[0].startswith(".so "):  # a page that only points to another
            continue
        start = headings[0] + 1
        end = next((n for n in range(start, len(lines)) if lines[n].startswith(".SH")), len(lines))
        name_line = " ".join(roff_text(line) for line in lines[start:end]).strip()
        _, dash, description = name_line.partition(" - ")
        text = "\n".join(t for t in (roff_text(line) for line in lines[end:]) if t)
        if dash and len(description.split()) >= 3 and len(text) > 200:
            found.append((path.name.removesuffix(".gz"), " ".join(description.split()), text[:max_chars]))
    return found


def stdlib_long_queries() -> list[tuple[str, str, str]]:
    """Functions whose whole docstring, at least 40 words, is the query: long queries, as ArguAna's are."""
    return stdlib_functions(whole_docstring, min_words=40)


SOURCES = {"stdlib": stdlib_functions, "stdlib-long": stdlib_long_queries, "man": manual_pages}


def module_docstring(module: str) -> str | None:
    path = Path(sysconfig.get_paths()["stdlib"]).joinpath(*module.split(".")).with_suffix(".py")
    return ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) if path.exists() else None


def stdlib_modules(name: str, max_queries: int, rng: random.Random) -> BeirDataset:
    """Every documented function is a document; a module's first docstring sentence asks for all its functions."""
    every = stdlib_functions(min_words=1)
    code_counts = Counter(code for _, _, code in every)
    functions = [f for f in every if code_counts[f[2]] == 1]
    by_module: dict[str, list[str]] = {}
    for doc_id, _, _ in functions:
        by_module.setdefault(doc_id.split(":")[0], []).append(doc_id)
    topics: dict[str, list[str]] = {}  # query -> relevant ids
    for module, ids in sorted(by_module.items()):
        docstring = module_docstring(module) if len(ids) >= 3 else None
        query = first_sentence(docstring) if docstring else ""
        if len(query.split()) >= 3:
            topics.setdefault(query, []).extend(ids)
    # two modules with one docstring (a C accelerator's Python twin, say) make one topic
    chosen = rng.sample(sorted(topics), min(max_queries, len(topics)))
    return BeirDataset(
        name=name,
        split="test",
        corpus=[{"_id": doc_id, "title": "", "text": code} for doc_id, _, code in functions],
        queries={f"q{n}": query for n, query in enumerate(chosen)},
        qrels={f"q{n}": dict.fromkeys(topics[query], 1) for n, query in enumerate(chosen)},
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "source",
        choices=sorted([*SOURCES, "stdlib-modules"]),
        help="stdlib functions (first sentence or whole docstring as the query, or a module's functions as the "
        "answers to its docstring) or manual pages",
    )
    parser.add_argument("out", type=Path, help="directory to write corpus.jsonl, queries.jsonl, qrels/test.tsv")
    parser.add_argument(
        "--documents",
        type=int,
        default=6000,
        help="documents in the corpus, at most (default 6000; stdlib-modules keeps them all)",
    )
    parser.add_argument("--queries", type=int, default=500, help="judged queries (default 500)")
    parser.add_argument("--seed", type=int, default=13)
    args = parser.parse_args()
    if args.source == "stdlib-modules":
        dataset = stdlib_modules(args.out.name, args.queries, random.Random(args.seed))
        write_beir(dataset, args.out)
        answers = sum(len(relevant) for relevant in dataset.qrels.values())
        print(
            f"wrote {len(dataset.corpus)} documents, {len(dataset.queries)} queries, {answers} answers, to {args.out}"
        )
        return
    every = SOURCES[args.source]()
    query_counts = Counter(query.lower() for _, query, _ in every)
    code_counts = Counter(code for _, _, code in every)
    unique = [f for f in every if query_counts[f[1].lower()] == 1 and code_counts[f[2]] == 1]
    rng = random.Random(args.seed)
    corpus = rng.sample(unique, min(args.documents, len(unique)))
    judged = rng.sample(corpus, min(args.queries, len(corpus)))
    dataset = BeirDataset(
        name=args.out.name,
        split="test",
        corpus=[{"_id": doc_id, "title": "", "text": text} for doc_id, _, text in corpus],
        queries={f"q{n}": query for n, (_, query, _) in enumerate(judged)},
        qrels={f"q{n}": {doc_id: 1} for n, (doc_id, _, _) in enumerate(judged)},
    )
    write_beir(dataset, args.out)
    print(
        f"{len(every)} items, {len(unique)} unique; wrote {len(corpus)} documents, {len(judged)} queries to {args.out}"
    )


if __name__ == "__main__":
    main()
