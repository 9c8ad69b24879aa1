"""Wire contracts: generated JSON Schema stays in step with the models; validation rules hold."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest
from pydantic import ValidationError

from ontofabric.contracts import OntologyQuery, QueryResponse, TokenVectors, schema


def test_committed_schemas_match_the_models() -> None:
    drifted = schema.drift()
    assert drifted == [], f"regenerate with `ontofabric contracts --write`: {drifted}"


def test_drift_is_detected(tmp_path: Path) -> None:
    directory = tmp_path
    schema.write(directory)
    assert schema.drift(directory) == []
    (directory / "ontology-query.schema.json").write_text("{}\n")
    assert schema.drift(directory) == ["ontology-query.schema.json"]


def test_query_defaults() -> None:
    query = OntologyQuery.model_validate_json('{"semanticQuery": "parse a file"}')
    assert (query.top_k, query.precision, query.follow_links, query.link_depth, query.branch) == (
        10,
        True,
        False,
        1,
        "main",
    )


@pytest.mark.parametrize(
    "body",
    [
        '{"semanticQuery": "x", "topK": 0}',
        '{"semanticQuery": "x", "topK": 101}',
        '{"semanticQuery": "x", "topK": "10"}',
        '{"semanticQuery": "x", "linkDepth": 2}',
        '{"semanticQuery": "x", "chunkLevel": "paragraph"}',
        '{"semanticQuery": "x", "provenance": "scraped"}',
        '{"semanticQuery": "x", "rerank": true}',
        '{"semanticQuery": "   "}',
        '{"semanticQuery": "x", "precision": "yes"}',
        '{"semanticQuery": "x", "branch": "../etc"}',
        '{"topK": 3}',
        "[]",
        '{"semanticQuery": "x", "options": {"retrievers": ["dense", "dense"]}}',
        '{"semanticQuery": "x", "options": {"retrievers": []}}',
        '{"semanticQuery": "x", "options": {"retrievers": ["sparse"]}}',
        '{"semanticQuery": "x", "options": {"candidates": 0}}',
        '{"semanticQuery": "x", "options": {"fusion": {"method": "magic"}}}',
        '{"semanticQuery": "x", "options": {"fusion": {"denseWeight": 1.5}}}',
        '{"semanticQuery": "x", "options": {"surprise": 1}}',
    ],
)
def test_invalid_queries_are_rejected(body: str) -> None:
    with pytest.raises(ValidationError):
        OntologyQuery.model_validate_json(body)


def test_response_serialises_meta_with_underscore() -> None:
    response = QueryResponse.model_validate(
        {
            "results": [],
            "_meta": {
                "ontologyVersion": "0-0000000000000000",
                "workspace": "w",
                "branch": "main",
                "hybrid": False,
                "reranked": False,
                "cacheHit": False,
                "backend": "tsvector",
                "retrievers": ["keyword"],
                "timingsMs": {"total": 1.0},
            },
        }
    )
    dumped = response.model_dump(mode="json")
    assert "_meta" in dumped
    assert dumped["_meta"]["ontologyVersion"] == "0-0000000000000000"


def test_options_are_accepted() -> None:
    query = OntologyQuery.model_validate_json(
        '{"semanticQuery": "x", "options": {"retrievers": ["keyword"], "candidates": 200,'
        ' "fusion": {"method": "convex", "denseWeight": 0.3}}}'
    )
    assert query.options is not None
    assert query.options.retrievers == ["keyword"]
    assert query.options.fusion is not None
    assert query.options.fusion.dense_weight == 0.3


def test_token_vectors_travel_as_base64_and_come_back_as_the_same_bits() -> None:
    signs = bytes(range(96))  # two 384-dimensional tokens
    tokens = TokenVectors.of_signs(384, signs)
    wire = tokens.model_dump_json()
    assert json.loads(wire)["data"] == base64.b64encode(signs).decode()
    assert TokenVectors.model_validate_json(wire).data == signs


@pytest.mark.parametrize(
    ("dimension", "size", "problem"),
    [(384, 0, "whole number"), (384, 95, "whole number"), (8, 1025, "more than 1024 tokens")],
)
def test_token_vectors_that_are_no_whole_tokens_are_rejected(dimension: int, size: int, problem: str) -> None:
    with pytest.raises(ValidationError, match=problem):
        TokenVectors.of_signs(dimension, b"\x01" * size)
    with pytest.raises(ValidationError, match="base64"):
        TokenVectors.model_validate({"dimension": 8, "data": "not base64!"})
    with pytest.raises(ValidationError, match="data"):  # valid padding, a character outside the alphabet
        TokenVectors.model_validate({"dimension": 16, "data": "AQI!!!=="})
