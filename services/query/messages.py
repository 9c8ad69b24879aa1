"""A pasted error or log message, and the code that writes it (pure).

An agent debugging pastes what the program printed: ``RuntimeError: Expected ASGI message 'websocket.accept', but
got 'http.response.start'.`` The code holds it as a template, ``f"Expected ASGI message 'websocket.accept', but got
{message_type!r}."``: the words the run filled in are nowhere in the source, and the template's own words are
common ones, so the retrievers alone rank the code raising it among others that share its words. Matching the
message against the chunk's string literals, with a template's fields (f-string fields, ``%`` and ``str.format``
ones) standing for whatever the run wrote there, tells the one that writes it.
"""

from __future__ import annotations

import difflib
import io
import itertools
import re
import time
import tokenize
from collections.abc import Collection, Iterable, Iterator, Mapping
from dataclasses import dataclass

FIELD = "\x00"
"""What a template's field becomes: text no message holds."""
MIN_COVERED = 0.6
"""The share of a message's characters a template must account for, in order, to be the message's; or
:data:`MIN_COVERED_WHOLE_TEMPLATE` where the template's own text is in the message nearly whole (long values filled
in: ``File at path /var/www/static/logo.png does not exist.``)."""
MIN_COVERED_WHOLE_TEMPLATE = 0.3
MIN_COVERED_MANY_FIELDS = 0.25
MANY_FIELDS = 3
"""A template of this many fields or more, found whole, needs only :data:`MIN_COVERED_MANY_FIELDS` of a message:
its values are most of it. tenacity's ``Retrying {fn} in {s} seconds as it {verb} {value}.`` with an exception
filled in is 28 % its own words (an MCP tester's); a template of one field as short (``Failed to download {url}``)
would have written pip's ``Failed to download wheel metadata for numpy from ...`` at 25 % (a review's)."""
WHOLE_TEMPLATE = 0.9
"""A template's own text found to this share is in the message whole (a few characters of punctuation aside)."""
MIN_COVERED_CHARS = 16
"""And at least so many characters: two short words anywhere are no message; but a message that is all of a
template's text (``Stream consumed``) may be as short as :data:`MIN_MESSAGE_CHARS`."""
MIN_MESSAGE_CHARS = 10
MIN_RUN = 12
"""A template's constant part counts when found whole in the message, or in a common run of at least this many
characters (a message pasted in part, or a part whose end the run filled differently)."""
MAX_MESSAGE_CHARS = 1_000
"""A message past this is a paste of more than one; it is left to the retrievers."""
MAX_NAME_CHARS = 300
"""An exception's dotted name, at most: the exception patterns' work grows with the square of what they read
before the first colon (a review's 8,000 characters of ``AErrorError...`` took 113 ms of the worker's interpreter),
so a line whose text before it is longer is read for a logged line only."""
MAX_PASTED_LINE_CHARS = MAX_MESSAGE_CHARS + 500
"""A pasted line longer than this is not read for a message (whose own text is at most :data:`MAX_MESSAGE_CHARS`,
the rest room for the exception's name or the log line's prefix)."""
MAX_SOURCE_CHARS = 200_000
"""A chunk's source read for its literals, at most (a module's chunk is its whole file)."""
MAX_LITERAL_CHARS = 2_000
"""A literal longer than this writes no message: left out, as are lines longer than :data:`MAX_LINE_CHARS` where
the source is read by its lines (the regular expressions' work grows with a line's length: a review's line of
99,000 escaped quotes took minutes, holding the interpreter's lock, the worker's every request waiting)."""
MAX_LINE_CHARS = 1_000
MAX_PLACES = 100
"""The places of each pair of the message's words read in a long source: a word pair a file repeats thousands of
times is no message's."""
MAX_COMPARED_CHARS = 20_000
"""The templates' characters compared with a message in one chunk, at most."""
MAX_RUN_PART_CHARS = 300
"""A constant part longer than this counts only when found whole: the search for a common run is Python's own,
and its work is the part's length times the message's."""
WHOLE_READ_CHARS = 4_000
"""A source longer than this (a module's chunk, a class, a long function) is read for its literals only on the
lines holding two of the message's words in a row and the lines beside them: Python's tokenizer reads about a
kilobyte in a millisecond, and a module's chunk holds its whole file."""

# `RuntimeError: ...`, `click.exceptions.UsageError: ...`, `MalformedRangeHeader: ...` (a name of two capitalised
# parts or more), `Error: ...` (click), `error: ...` (argparse), with the exception's module or not.
_RAISED = re.compile(
    r"(?P<name>(?:[A-Za-z_]\w*\.)*(?:[A-Z]\w*(?:Error|Exception|Warning|Exit|Interrupt|Failure|Fault|Timeout)\w*"
    r"|[A-Z][a-z0-9]+(?:[A-Z][a-z0-9]*)+|Error|error|Warning|warning|Fatal|fatal|FATAL))\s*:\s+(?P<message>\S.*)",
    re.DOTALL,
)
# A traceback's last line: whatever the exception's name.
_TRACED = re.compile(r"(?P<name>(?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*)\s*:\s+(?P<message>\S.*)", re.DOTALL)
# `INFO:     Started server process [12]`, `WARNING - x`, `[ERROR] x`, `2026-12-05 13:01:02,123 ERROR x`, and
# logging's own default, `WARNING:tenacity:Retrying ...` (`%(levelname)s:%(name)s:%(message)s`, no space after the
# logger's name: an MCP tester's line was read with `tenacity:` as part of its message, and its writer missed).
_LOGGED = re.compile(
    r"(?:\[?\d{4}-\d\d-\d\d[T ][\d:.,]+\]?\s+)?(?:\[\w+\]\s+)?\[?(?P<level>DEBUG|INFO|WARNING|WARN|ERROR|CRITICAL)\]?"
    r"(?:(?<=[A-Z]):[\w.-]+:(?![/\\])(?=\S)|(?:\s*[:\-|]\s*|\s+)(?:[\w.]+\s*[:\-|]\s+)?)(?P<message>\S.*)",
    re.DOTALL,
)
_BUILTINS = (
    "NoneType|str|int|float|complex|bool|bytes|bytearray|list|dict|tuple|set|frozenset|function|method|module|type"
    "|object|generator|coroutine|async_generator|builtin_function_or_method|method-wrapper|range|memoryview"
    "|property|classmethod|staticmethod|NotImplementedType|ellipsis|dict_keys|dict_values|dict_items"
)
# What the interpreter says of its own objects: `'NoneType' object has no attribute 'send'`, `'str' object is not
# callable`. A library's template of the same words (`'{}' object has no attribute '{}'`, starlette's State) wrote
# it for its own class, and was placed first at 1.0 for the interpreter's message (a review's).
_INTERPRETERS = re.compile(rf"'(?:{_BUILTINS})' object\b|\bNoneType\b")
_FRAME_LINE = re.compile(r'\s*(?:File\s+"|Traceback\s+\(most recent call last\)|\^+\s*$|~+)')
_ASKING = re.compile(r"(?i)(?:what|why|how|where|when|which|who)\b")
"""A message's first word that asks (``Could not find ...`` is a message, ``how does ...`` no)."""
_QUESTION = re.compile(r"(?i)(?:what|why|how|where|when|which|who|does|do|is|are|can|should|could|explain)\b")
_QUOTES = "`'\""


@dataclass(frozen=True)
class MessageAsked:
    """The message a query pastes, and the exception it names (``RuntimeError``) where it names one."""

    text: str
    raised: str | None = None


def message_asked(query: str) -> MessageAsked | None:
    """The message a query is a paste of: an exception's line (``ValueError: ...``, the last line of a traceback
    pasted whole or in part) or a logged line (``ERROR: ...``); None for anything else, a question about an error
    included (``why does X raise ValueError: ...`` is asked of the retrievers)."""
    lines = [line.rstrip() for line in query.strip().splitlines() if line.strip()]
    if not lines:
        return None
    traced = any(_FRAME_LINE.match(line) for line in lines)
    if len(lines) > 1:
        # A traceback's tail: its last line is the exception's; frames and the code lines under them are not.
        unframed = [line for line in lines if not _FRAME_LINE.match(line) and not line.startswith((" ", "\t"))]
        if not unframed:
            return None
        lines = unframed[-1:]
    line = lines[0].strip()
    if len(line) > MAX_PASTED_LINE_CHARS:
        return None
    if len(line) >= 2 and line[0] == line[-1] and line[0] in _QUOTES:
        line = line[1:-1].strip()
    if _QUESTION.match(line):
        return None
    named = len(line.partition(":")[0]) <= MAX_NAME_CHARS
    raised = (_TRACED if traced else _RAISED).fullmatch(line) if named else None
    if raised is not None:
        name = raised["name"]
        exception = name.rpartition(".")[2]
        return _asked(raised["message"], exception if exception[:1].isupper() and exception != "Error" else None)
    logged = _LOGGED.fullmatch(line)
    if logged is not None:
        return _asked(logged["message"], None)
    return None


def _asked(message: str, raised: str | None) -> MessageAsked | None:
    text = " ".join(message.split())
    if len(text) > MAX_MESSAGE_CHARS or len(text) < MIN_MESSAGE_CHARS or " " not in text:
        return None
    if _INTERPRETERS.search(text) or _ASKING.match(text) or text.endswith("?"):  # a question after a prefix
        return None
    return MessageAsked(text, raised)


def templates(source: str) -> list[str]:
    """The string literals of a chunk's code that could write a message, each as a template: its fields as
    :data:`FIELD`, adjacent literals joined (Python joins them), docstrings (a literal standing alone as a
    statement) left out. Code that does not tokenize (a window of a long function) gives what its lines do."""
    source = source[:MAX_SOURCE_CHARS]
    try:
        return _with_text(_literals(source))
    except (tokenize.TokenError, IndentationError, SyntaxError):
        return _with_text(_line_literals(source))


def _with_text(found: Iterable[str]) -> list[str]:
    """The templates that hold some text besides their fields."""
    return [template for template in found if template.replace(FIELD, "").strip()]


_STATEMENT_START = {tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENCODING}
_SKIPPED = {tokenize.NL, tokenize.COMMENT}


def _literals(source: str) -> Iterator[str]:
    """The templates of the source's literals, by its tokens."""
    tokens = [t for t in tokenize.generate_tokens(io.StringIO(source).readline) if t.type not in _SKIPPED]
    index = 0
    while index < len(tokens):
        if tokens[index].type != tokenize.STRING:
            index += 1
            continue
        first, joined = index, []
        # Adjacent literals, and literals added together ("... " + "..."), are one text.
        while index < len(tokens) and tokens[index].type == tokenize.STRING:
            joined.append(tokens[index].string)
            index += 1
            if _added_literal(tokens, index):
                index += 1
        before = tokens[first - 1].type if first else tokenize.NEWLINE
        after = tokens[index].type if index < len(tokens) else tokenize.ENDMARKER
        if before in _STATEMENT_START and after in (tokenize.NEWLINE, tokenize.ENDMARKER) and len(joined) == 1:
            continue  # a docstring, or a literal standing alone: no message is written with it
        if sum(map(len, joined)) <= MAX_LITERAL_CHARS:
            yield "".join(template_of(literal) for literal in joined)


def _added_literal(tokens: list[tokenize.TokenInfo], index: int) -> bool:
    """Whether ``+`` and a literal follow."""
    return (
        index + 1 < len(tokens)
        and tokens[index].type == tokenize.OP
        and tokens[index].string == "+"
        and tokens[index + 1].type == tokenize.STRING
    )


_LINE_LITERAL = re.compile(r"""(?i)(?<![\w'"\\])([rbuf]{0,2})('(?:\\.|[^'\\\n])*'|"(?:\\.|[^"\\\n])*")""")


_TRIPLE_QUOTED = re.compile(r"""(?i)[rbuf]{0,2}(\"\"\"|\'\'\').*?(?:\1|(?=\n)|$)""")
_JOINING = re.compile(r"[\s+]*")


def _line_literals(source: str) -> Iterator[str]:
    """The one-line literals of code read without its tokens (a window cut inside a string, the lines of a long
    chunk), those next to each other or added together joined; triple-quoted text (docstrings, mostly) left out."""
    text = "\n".join(line if len(line) <= MAX_LINE_CHARS else "" for line in source.split("\n"))
    text = _TRIPLE_QUOTED.sub(" ", text)
    pending, last_end = "", -1
    for match in _LINE_LITERAL.finditer(text):
        template = template_of(match[1] + match[2])
        if last_end >= 0 and not _JOINING.fullmatch(text, last_end, match.start()):
            yield pending
            pending = ""
        if len(pending) + len(template) > MAX_LITERAL_CHARS:
            pending, last_end = "", -1
            continue
        pending += template
        last_end = match.end()
    if last_end >= 0:
        yield pending


_PREFIX = re.compile(r"(?i)[rbuf]*")
_FORMAT_FIELD = re.compile(r"\{\{|\}\}|\{[^{}]*\}")
_PERCENT_FIELD = re.compile(
    r"%%|%(?:\([^()\n]{0,64}\))?[#0\- +]{0,4}(?:\d{1,4}|\*)?(?:\.(?:\d{1,4}|\*))?[hlL]?[diouxXeEfFgGcrsa]"
)
_ESCAPE = re.compile(r"\\(?:\n|[nrt]|.)")


def template_of(literal: str) -> str:
    """A literal as written (``f"got {x!r}"``) as a template (``got \\x00``): quotes and prefix off, escapes read,
    fields (f-string and ``str.format`` braces, ``%`` conversions) as :data:`FIELD`."""
    prefix = _PREFIX.match(literal)
    start = prefix.end() if prefix else 0
    quote = literal[start : start + 3] if literal[start : start + 3] in ('"""', "'''") else literal[start : start + 1]
    body = literal[start + len(quote) : len(literal) - len(quote)]
    if "r" not in literal[:start].lower():
        body = _ESCAPE.sub(_escaped, body)
    # Braces are fields in f-strings and in strings str.format fills; a literal brace elsewhere is rare in a message.
    body = _FORMAT_FIELD.sub(lambda m: m[0][0] if m[0] in ("{{", "}}") else FIELD, body)
    body = _PERCENT_FIELD.sub(lambda m: "%" if m[0] == "%%" else FIELD, body)
    return body


def _escaped(match: re.Match[str]) -> str:
    escape = match[0]
    if escape in ("\\n", "\\r", "\\t", "\\\n"):
        return " "
    return escape[1:]


def covered(message: str, template: str) -> tuple[int, int]:
    """How many of the message's characters the template's constant parts account for, in order: a part found
    whole (three characters or more), or its longest common run with what is left of the message where that run
    is :data:`MIN_RUN` characters or more; and how many characters those parts hold. Case and runs of white space
    are ignored."""
    text = " ".join(message.split()).casefold()
    position, total, own = 0, 0, 0
    for part in template.split(FIELD):
        part = " ".join(part.split()).casefold()
        if len(part) < 3:
            continue
        own += len(part)
        found = text.find(part, position)
        if found >= 0:
            total += len(part)
            position = found + len(part)
            continue
        if len(part) < MIN_RUN or len(part) > MAX_RUN_PART_CHARS:
            continue
        run = difflib.SequenceMatcher(None, text, part, autojunk=False).find_longest_match(
            position, len(text), 0, len(part)
        )
        if run.size >= MIN_RUN:
            total += run.size
            position = run.a + run.size
    return total, own


def share_written(message: str, template: str) -> float:
    """The share of the message (0 to 1) the template accounts for (:func:`covered`), or 0 when that does not
    make it the message's: less than :data:`MIN_COVERED` of it, or :data:`MIN_COVERED_WHOLE_TEMPLATE` where the
    template's own text is there nearly whole; fewer than :data:`MIN_COVERED_CHARS` characters unless the message
    is all of the template's text."""
    length = len(" ".join(message.split()))
    found, own = covered(message, template)
    if not length or not found:
        return 0.0
    share = found / length
    whole = found >= WHOLE_TEMPLATE * own
    if found < MIN_COVERED_CHARS and not (whole and share >= WHOLE_TEMPLATE):
        return 0.0
    least = MIN_COVERED_MANY_FIELDS if template.count(FIELD) >= MANY_FIELDS else MIN_COVERED_WHOLE_TEMPLATE
    if share < MIN_COVERED and not (whole and share >= least):
        return 0.0
    return min(1.0, share)


COMMON_WORDS = frozenset(
    "a an the is are was were be been not no to of in on at by for from with and or as it its this that if can "  # noqa: SIM905
    "cannot must should will has have had do does".split()
)
"""Words in most code's text: two of them in a row (``is not``, ``must be``) tell no source apart."""


def written_by(message: str, source: str, name: str = "", until: float | None = None) -> float:
    """The share of the message (0 to 1) the source's best template accounts for (:func:`share_written`); 0: the
    source does not write this message. A source holding no two of the message's words in a row, one of them not
    a :data:`COMMON_WORDS`, is not read: the template's own text holds such a pair. ``name``: the chunk's qualified
    name, for a template of the interpreter's own words (:func:`_the_interpreters`); ``until``: a
    ``time.thread_time()`` (this thread's CPU) past which no more of its templates are compared (a review's chunk
    took 11 s)."""
    words = " ".join(message.split()).casefold().split(" ")
    pairs = [pair for pair in itertools.pairwise(words) if not COMMON_WORDS.issuperset(pair)]
    if not pairs and len(words) > 1:
        pairs = list(itertools.pairwise(words))
    source = source[:MAX_SOURCE_CHARS]
    folded = source.casefold()
    if len(folded) != len(source):  # a character folding to several: lines found by the folded text's own
        source = folded
    found_at = [at for pair in pairs for at in itertools.islice(_places(folded, " ".join(pair)), MAX_PLACES)]
    if not found_at:
        return 0.0
    if len(source) > WHOLE_READ_CHARS:
        # The line holding the pair, and those before and after it (a literal continued on the next), each line
        # once where the windows overlap.
        text = "\n;\n".join(source[start:end] for start, end in _merged(_lines_around(source, at) for at in found_at))
        found = _with_text(_line_literals(text))
    else:
        found = templates(source)
    best, compared = 0.0, 0
    for template in dict.fromkeys(found):
        compared += len(template)
        if compared > MAX_COMPARED_CHARS or (until is not None and time.thread_time() > until):
            break
        share = share_written(message, template)
        if share > best and not (_the_interpreters(template) and not _names_a_value(message, template, source, name)):
            best = share
    return best


def _merged(windows: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """Overlapping or touching (start, end) windows as one each, in order."""
    merged: list[tuple[int, int]] = []
    for start, end in sorted(windows):
        if merged and start <= merged[-1][1] + 1:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


# The interpreter's words of an object or a module it did not find something in: a library's template of the same
# words (starlette's `'{}' object has no attribute '{}'`) writes them of its own class only (a review's `'Response'
# object has no attribute 'json_body'` placed starlette's State first at 1.0).
_INTERPRETER_PHRASE = re.compile(
    r"(?i)object has no attribute|has no attribute|is not subscriptable|object is not callable|is not iterable"
    r"|not supported between instances|positional arguments? but|unexpected keyword argument|required positional"
)
_QUOTED_VALUE = re.compile(r"'([^'\n]{1,200})'|" + r'"([^"\n]{1,200})"')


def _the_interpreters(template: str) -> bool:
    return _INTERPRETER_PHRASE.search(template.replace(FIELD, " ")) is not None


def _names_a_value(message: str, template: str, source: str, name: str) -> bool:
    """Whether a quoted value of the message that is no text of the template is in the source or its name: the
    class or module the interpreter's words were said of is the chunk's."""
    own = template.replace(FIELD, " ")
    values = [a or b for a, b in _QUOTED_VALUE.findall(message)]
    return any(value not in own and (value in source or value in name) for value in values)


def _places(text: str, part: str) -> Iterator[int]:
    """Where ``part`` starts in ``text``, each place."""
    at = text.find(part)
    while at >= 0:
        yield at
        at = text.find(part, at + 1)


def _lines_around(text: str, at: int) -> tuple[int, int]:
    """Where the line holding ``at`` starts, with the line before it, and ends, with the line after it."""
    start = text.rfind("\n", 0, max(0, text.rfind("\n", 0, at))) + 1
    own_end = text.find("\n", at)
    end = -1 if own_end < 0 else text.find("\n", own_end + 1)
    return start, len(text) if end < 0 else end


SHARE_STEPS = 20
"""Shares of a message within one twentieth of each other are one tier: the pipeline's order decides among them."""


def message_order(shares: Mapping[str, float], raising: Collection[str] = ()) -> dict[str, int]:
    """Each chunk's place among those writing the message (lower first), as ``symbols.related_first`` reads
    distances: the larger share of the message first, then those raising the exception the paste names
    (``raising``)."""
    return {
        doc_id: 2 * round((1.0 - share) * SHARE_STEPS) + (doc_id not in raising) for doc_id, share in shares.items()
    }


def raises(source: str, exception: str) -> bool:
    """Whether the source raises (or makes) the exception by that name: ``raise ValueError(``, ``ValueError(``."""
    named = re.escape(exception)
    return re.search(rf"(?<![\w.]){named}\s*\(|\.{named}\s*\(|\braise\s+(?:[\w.]+\.)?{named}\b", source) is not None
