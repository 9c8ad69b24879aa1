"""Code-aware analysis before PostgreSQL's parser."""

from __future__ import annotations

import pytest

from ontofabric.shared.analysis import analyse, identifier_parts


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("writeBoolean(self, n)", "writeBoolean write Boolean(self, n)"),
        ("os.path.join(a)", "os.path.join os path join(a)"),
        ("getHTTPResponse", "getHTTPResponse get HTTP Response"),
        ("read_file", "read_file read file"),
        ("base64", "base64 base 64"),
        ("low-density lipoprotein", "low density lipoprotein"),
        ("plain words stay", "plain words stay"),
        ("mRNA", "mRNA"),
    ],
)
def test_analyse(text: str, expected: str) -> None:
    assert analyse(text) == expected


def test_identifier_parts_drop_single_characters() -> None:
    assert identifier_parts("x_y") == []
    assert identifier_parts("HTMLParser") == ["HTML", "Parser"]
