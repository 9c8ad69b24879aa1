"""A pasted error or log message against the templates of a chunk's string literals (pure)."""

from __future__ import annotations

import textwrap
from collections.abc import Callable

import pytest

from ontofabric.services.query.messages import (
    FIELD,
    MessageAsked,
    covered,
    message_asked,
    message_order,
    raises,
    share_written,
    template_of,
    templates,
    written_by,
)

SENDER = textwrap.dedent(
    '''
    async def send(self, message):
        """Send a message: raises RuntimeError, "Expected a message", when out of order."""
        message_type = message["type"]
        if message_type != "websocket.accept":
            raise RuntimeError(
                f"Expected ASGI message 'websocket.accept', but got {message_type!r}."
            )
        logger.info("Started server process [%d]", os.getpid())
        raise UsageError(_("Got unexpected extra argument ({args})").format(args=" ".join(rest)))
        raise ValueError(
            "a timeout must be a number of seconds, "  # joined, as Python joins them
            "not %(kind)s" % {"kind": kind}
        )
    '''
)


@pytest.mark.parametrize(
    ("query", "asked"),
    [
        (
            "RuntimeError: Expected ASGI message 'websocket.accept', but got 'http.response.start'.",
            MessageAsked("Expected ASGI message 'websocket.accept', but got 'http.response.start'.", "RuntimeError"),
        ),
        # With its module, in backticks, and the generic prefixes click and argparse print.
        (
            "`click.exceptions.UsageError: No such option: --colour`",
            MessageAsked("No such option: --colour", "UsageError"),
        ),
        ("Error: No such option: --colour", MessageAsked("No such option: --colour")),
        ("error: argument --port: invalid int value: 'x'", MessageAsked("argument --port: invalid int value: 'x'")),
        # Logged lines, with a level as the logging module and uvicorn print it.
        ("INFO:     Started server process [4021]", MessageAsked("Started server process [4021]")),
        (
            "2026-12-05 13:01:02,123 WARNING app.db: pool exhausted after 30 s",
            MessageAsked("pool exhausted after 30 s"),
        ),
        # logging's default format, no space after the logger's name (an MCP tester's: `tenacity:` was read as
        # part of the message).
        (
            "WARNING:tenacity:Retrying __main__.fetch in 2.0 seconds as it raised ConnectionError: boom.",
            MessageAsked("Retrying __main__.fetch in 2.0 seconds as it raised ConnectionError: boom."),
        ),
        ("ERROR:httpx._client:Could not connect to the host", MessageAsked("Could not connect to the host")),
        ("ERROR:Could not connect to the host", MessageAsked("Could not connect to the host")),
        ("WARNING:my-app:Retrying in 2 seconds now", MessageAsked("Retrying in 2 seconds now")),
        # A URL or a path is no logger's name (a review's).
        ("ERROR:https://api.example.org/v1 returned 500", MessageAsked("https://api.example.org/v1 returned 500")),
        # A traceback's tail: its last line is the exception's, frames and code lines are not.
        (
            'Traceback (most recent call last):\n  File "app.py", line 3, in <module>\n    main()\n'
            "ValueError: a timeout must be a number of seconds, not str",
            MessageAsked("a timeout must be a number of seconds, not str", "ValueError"),
        ),
        # Any exception's name in a traceback; alone, one of two capitalised parts or more.
        (
            'Traceback (most recent call last):\n  File "app.py", line 3, in <module>\n'
            "starlette.websockets.WebSocketDisconnected: WebSocket is not connected.",
            MessageAsked("WebSocket is not connected.", "WebSocketDisconnected"),
        ),
        (
            "MalformedRangeHeader: Range header: start must be less than end",
            MessageAsked("Range header: start must be less than end", "MalformedRangeHeader"),
        ),
        ("Note: the cache is kept for a day", None),
        # The interpreter's own messages of its objects (a review's: a library template of the same words went
        # first at 1.0), and a question after a prefix.
        ("AttributeError: 'NoneType' object has no attribute 'send'", None),
        ("TypeError: 'str' object is not callable", None),
        ("HTTPException: how does starlette handle a 404 here", None),
        # A message whose first word could ask (a review's: these were read as questions).
        (
            "RuntimeError: Could not find a usable event loop",
            MessageAsked("Could not find a usable event loop", "RuntimeError"),
        ),
        ("ValueError: Can't patch loop of type x", MessageAsked("Can't patch loop of type x", "ValueError")),
        (
            "AttributeError: 'State' object has no attribute 'user'",
            MessageAsked("'State' object has no attribute 'user'", "AttributeError"),
        ),
        # Not a paste: a question about an error, a word alone, a phrase, too short a message.
        ("why does RuntimeError: Expected ASGI message happen", None),
        ("how do I read a websocket message", None),
        ("Expected ASGI message 'websocket.accept', but got 'http.response.start'.", None),
        ("RuntimeError: Stream consumed", MessageAsked("Stream consumed", "RuntimeError")),
        ("ValueError: bad", None),
        ("ValueError: unreadable", None),
        ("ValueError", None),
        ("", None),
    ],
)
def test_message_asked_takes_an_exceptions_or_a_logged_line(query: str, asked: MessageAsked | None) -> None:
    assert message_asked(query) == asked


def test_templates_are_the_codes_literals_with_fields_and_without_docstrings() -> None:
    found = templates(SENDER)
    assert f"Expected ASGI message 'websocket.accept', but got {FIELD}." in found
    assert f"Started server process [{FIELD}]" in found
    assert f"Got unexpected extra argument ({FIELD})" in found
    assert f"a timeout must be a number of seconds, not {FIELD}" in found  # two literals, joined
    assert "one and two" in templates('x = f("one " + "and two")')  # added too
    assert not any("out of order" in template for template in found)  # the docstring
    # Code that does not tokenize (a window cut inside a string) still gives its one-line literals.
    cut = 'x = """never closed\n    raise KeyError("no such key: %r" % key)\n'
    assert f"no such key: {FIELD}" in templates(cut)


@pytest.mark.parametrize(
    ("literal", "template"),
    [
        ("f'got {x!r} and {{braces}}'", f"got {FIELD} and {{braces}}"),
        ('"%(name)s is %.2f%% done"', f"{FIELD} is {FIELD}% done"),
        ('r"\\d+ {0:>4}"', f"\\d+ {FIELD}"),
        ('"""two\\nlines"""', "two lines"),
        ("b'bytes \\'quoted\\''", "bytes 'quoted'"),
    ],
)
def test_template_of_reads_a_literal_as_written(literal: str, template: str) -> None:
    assert template_of(literal) == template


def test_covered_counts_the_constant_parts_found_in_order() -> None:
    template = f"Expected ASGI message 'websocket.accept', but got {FIELD}."
    message = "Expected ASGI message 'websocket.accept', but got 'http.response.start'."
    own = len("Expected ASGI message 'websocket.accept', but got")  # spaces at the ends aside; "." too short
    assert covered(message, template) == (own, own)
    assert covered(message.upper(), template) == covered(message, template)  # case and spaces aside
    # Out of order, a part counts once the one before it is found.
    assert covered("but got x. Expected ASGI message", f"Expected ASGI message {FIELD} but got {FIELD}.") == (
        len("Expected ASGI message"),
        len("Expected ASGI message") + len("but got"),
    )
    # A message pasted in part: a long common run of a longer part counts.
    assert covered("a timeout must be a number", f"a timeout must be a number of seconds, not {FIELD}")[0] == 26


def test_share_written_needs_most_of_the_message_or_all_of_the_template() -> None:
    template = f"File at path {FIELD} does not exist."
    # Long values filled in: the template's text is there whole, a third of the message.
    assert share_written("File at path /var/www/static/images/logo.png does not exist.", template) > 0.4
    assert share_written("File at path x does not exist", f"{template} Try {FIELD} or {FIELD} instead.") > 0.8
    long_value = "Could not load the settings from /etc/app/production/config.toml, the disk being full"
    assert share_written(long_value, f"Could not load {FIELD}") == 0.0  # all of a short template, little of it
    # Short: all of the message, all of the template; or not enough of either.
    assert share_written("Stream consumed", "Stream consumed") == 1.0
    assert share_written("Stream consumed again", "Stream consumed") == 0.0
    assert share_written("the stream was consumed", f"{FIELD} was consumed") == 0.0


def test_written_by_needs_most_of_the_message() -> None:
    assert written_by("Expected ASGI message 'websocket.accept', but got 'http.response.start'.", SENDER) > 0.6
    assert written_by("Started server process [4021]", SENDER) == pytest.approx(24 / 29)
    assert written_by("Got unexpected extra argument (a b)", SENDER) > 0.8
    # The same words elsewhere, or a few of them: no.
    assert written_by("Expected a websocket message, got nothing at all in this server process", SENDER) == 0.0
    assert written_by("server process started", SENDER) == 0.0
    assert written_by("anything", "x = 1") == 0.0


def test_a_template_found_whole_writes_a_message_with_long_values_filled_in() -> None:
    """An MCP tester's: tenacity's retry line with the exception filled in (`raised ConnectionError: boom`) is
    mostly values: the template's own words are 28 % of it, under the 30 % once asked."""
    source = (
        "def log_it(retry_state):\n"
        "    msg = (\n"
        '        f"Retrying {fn_name} "\n'
        '        f"in {sec_format % retry_state.next_action.sleep} seconds as it {verb} {value}."\n'
        "    )\n"
        "    logger.log(log_level, msg)\n"
    )
    message = "Retrying __main__.fetch in 2.0 seconds as it raised ConnectionError: boom."
    assert written_by(message, source) == pytest.approx(21 / len(message))  # "retrying", "seconds as it"
    # A template of one field as short is not read so (a review's: pip's message for a template of the same words).
    one_field = 'def f(url):\n    raise DownloadError(f"Failed to download {url}")\n'
    assert written_by("Failed to download wheel metadata for numpy from https://pypi.org/simple", one_field) == 0.0
    # Fewer of the template's words found, or more of the message besides them: not its message.
    assert written_by("Retrying __main__.fetch later, as it raised ConnectionError: boom.", source) == 0.0
    assert written_by(message.replace("boom.", "the server at 10.0.0.1 closed the connection."), source) == 0.0


def test_message_order_puts_the_larger_share_then_the_raiser_first() -> None:
    order = message_order({"a": 0.7, "b": 0.9, "c": 0.71, "d": 0.7}, raising={"d"})
    assert sorted(order, key=lambda doc_id: (order[doc_id], doc_id)) == ["b", "d", "a", "c"]
    assert raises(SENDER, "RuntimeError")
    assert raises("raise errors.UsageError(x)", "UsageError")
    assert not raises("except RuntimeError:", "RuntimeError")
    assert not raises("MyRuntimeError(x)", "RuntimeError")


def test_a_long_source_is_read_on_the_lines_sharing_words_with_the_message() -> None:
    """A module's chunk is its whole file: only the lines holding the message's words, and those beside them, are
    read (literals continued on the next line joined, triple-quoted text left out)."""
    filler = "".join(f"def f{i}(x):\n    return x + {i}\n\n" for i in range(300))
    source = (
        'def explain():\n    """Provided reload directories did not contain valid directories, at all."""\n\n'
        + filler
        + "def resolve(dirs):\n    logger.warning(\n"
        + '        "Provided reload directories %s did not contain valid "\n'
        + '        + "directories, watching current working directory.",\n'
        + "        dirs,\n    )\n"
    )
    assert len(source) > 4_000
    message = (
        "Provided reload directories ['src'] did not contain valid directories, watching current working directory."
    )
    assert written_by(message, source) > 0.8
    docstring_only = source[: source.index("def resolve")]
    assert written_by("Provided reload directories did not contain valid directories, at all.", docstring_only) == 0.0


@pytest.mark.parametrize(
    "make",
    [
        lambda n: "def f():\n    x = 'connection refused " + "\\'" * n + "\n",  # escaped quotes, never closed
        lambda n: "def f():\n    raise X('connection refused " + "%(" * n + "')\n",  # % fields, never closed
        lambda n: "x = '" + "connection refused " * n + "'\n",  # one literal, the message's words over and over
        lambda n: "connection refused " * n,  # the pair everywhere, no literal
    ],
)
def test_reading_a_source_grows_with_it_not_with_its_square(make: Callable[[int], str]) -> None:
    """A review's: a line of 99,000 escaped quotes took minutes (each a start the pattern tried to the line's end),
    the interpreter's lock held throughout. Ten times the source must not cost a hundred times the time."""
    import time

    def timed(n: int) -> float:
        started = time.perf_counter()
        for _ in range(3):
            written_by("connection refused by the remote host", make(n))
        return time.perf_counter() - started

    small, large = timed(9_900), timed(99_000)
    assert large < max(30 * small, 0.5), (small, large)


@pytest.mark.parametrize(
    "make",
    [
        # n characters of a name the exception's pattern may end at any of its places, and no message after the
        # colon: it tries every one of them
        lambda n: "A" + "Error" * ((n - 1) // 5) + ":",
        lambda n: "x." * (n // 2) + "ValueError: the disk is full again",  # a dotted name as long as the paste
        lambda n: "WARNING:" + "a" * n,
    ],
)
def test_reading_a_pasted_line_grows_with_it_not_with_its_square(make: Callable[[int], str]) -> None:
    """A review's 8,000 characters of ``AErrorError...`` took 113 ms of the worker's interpreter."""
    import time

    def timed(n: int) -> float:
        started = time.perf_counter()
        for _ in range(40):
            message_asked(make(n))
        return time.perf_counter() - started

    small, large = timed(140), timed(1_400)  # characters: under the length a pasted line is read to
    assert large < max(30 * small, 0.05), (small, large)
    assert message_asked(make(16_000)) is None  # longer than a message and its name: left to the retrievers


def test_the_interpreters_words_count_only_of_the_class_or_module_the_chunk_is() -> None:
    """A review's: `'Response' object has no attribute 'json_body'` (the interpreter's, of a class of another
    package) placed starlette's State first at 1.0, whose template has the same words."""
    source = textwrap.dedent(
        """
        def __getattr__(self, key):
            try:
                return self._state[key]
            except KeyError:
                message = "'{}' object has no attribute '{}'"
                raise AttributeError(message.format(self.__class__.__name__, key))
        """
    )
    name = "starlette.datastructures.State.__getattr__"
    assert written_by("'State' object has no attribute 'user'", source, name) > 0.5
    assert written_by("'Response' object has no attribute 'json_body'", source, name) == 0.0
    assert written_by("module 'collections' has no attribute 'Mapping'", source, name) == 0.0
    assert raises("raise TooLarge", "TooLarge")  # bare
    assert raises("raise errors.TooLarge from None", "TooLarge")
