"""Wire contracts: generated JSON Schema stays in step with the models; validation rules hold."""

from __future__ import annotations

import base64
import json
import os
import re
import subprocess
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from pydantic import BaseModel, ValidationError
from pydantic.alias_generators import to_camel

from ontofabric.contracts import DeltaEnvelope, OntologyQuery, QueryError, QueryResponse, TokenVectors, schema
from ontofabric.contracts.documents import BRANCH, WORKSPACE
from ontofabric.contracts.query import FILTERS
from ontofabric.services.query.requests import read_request
from ontofabric.shared import asyncapi
from ontofabric.shared.subjects import OPERATIONS, Names, decode_token

from . import factories


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
        '{"semanticQuery": "x", "topK": 5.5}',
        '{"semanticQuery": "x", "topK": 1e300}',
        '{"semanticQuery": "x", "topK": true}',
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
        # Another method's parameter was ignored in silence (an independent tester's finding).
        '{"semanticQuery": "x", "options": {"fusion": {"method": "convex", "rrfK": 10}}}',
        '{"semanticQuery": "x", "options": {"fusion": {"method": "rrf", "denseWeight": 0.3}}}',
        '{"semanticQuery": "x", "options": {"fusion": {"method": "adaptive", "denseWeight": 0.3}}}',
        '{"semanticQuery": "x", "options": {"surprise": 1}}',
        '{"relatedTo": {"relation": "friends", "symbol": "f"}}',
        '{"relatedTo": {"relation": "callers", "symbol": "what calls f"}}',
        '{"relatedTo": {"relation": "callers"}}',
        '{"relatedTo": {"relation": "callers", "symbol": "f", "depth": 2}}',
        '{"relatedTo": {"relation": "callers", "symbol": "a\\u202eb"}}',  # no identifier, past ASCII or not
        '{"relatedTo": {"relation": "callers", "symbol": "1abc"}}',
        '{"relatedTo": {"relation": "callers", "symbol": "' + "\ufb03" * 300 + '"}}',  # 900 characters after NFKC
    ],
)
def test_invalid_queries_are_rejected(body: str) -> None:
    with pytest.raises(ValidationError):
        OntologyQuery.model_validate_json(body)


def test_a_query_with_a_sign_that_shows_is_taken_whatever_marks_surround_it() -> None:
    published = json.loads((schema.SCHEMA_DIR / "ontology-query.schema.json").read_text())
    validator = jsonschema.Draft202012Validator(published)
    for text in ("\u200bparse\u200e", "\u0600", "\u200b\U0001f600"):  # the Arabic number sign is seen
        assert OntologyQuery.model_validate({"semanticQuery": text}).semantic_query == text
        assert validator.is_valid({"semanticQuery": text})
    # Ignorable characters past the Basic Multilingual Plane, alone, are refused by the validator.
    with pytest.raises(ValidationError, match="text that shows"):
        OntologyQuery.model_validate({"semanticQuery": "\U000e0001 \U000e0041\U0001d173"})


def test_what_shows_nothing_is_whitespace_and_the_default_ignorable_characters_alone() -> None:
    """Read in one pass (a review's: a test of each character against each range took 17 ms a 63 kB body, read
    before a worker judges its load); the same characters as str.isspace and the ranges, every 7th code point."""
    from ontofabric.contracts.query import _DEFAULT_IGNORABLE, SHOWS_NOTHING

    for point in range(0, 0x110000, 7):
        character = chr(point)
        expected = character.isspace() or any(first <= point <= last for first, last in _DEFAULT_IGNORABLE)
        assert (SHOWS_NOTHING.fullmatch(character) is not None) == expected, hex(point)
    assert SHOWS_NOTHING.fullmatch("\u200b \U000e0041\n")
    assert not SHOWS_NOTHING.fullmatch("\u200b" * 1000 + "x")


def test_a_whole_number_written_with_a_point_is_an_integer_as_json_schema_counts_it() -> None:
    """A conformance tester's: `topK: 5.0` was refused over NATS, and taken by the gateway."""
    body = '{"semanticQuery": "x", "topK": 5.0, "options": {"candidates": 40.0, "fusion": {"rrfK": 60.0}}}'
    query = OntologyQuery.model_validate_json(body)
    assert (query.top_k, query.options.candidates, query.options.fusion.rrf_k) == (5, 40, 60)
    assert type(query.top_k) is int


def test_a_relation_asked_by_structure_needs_no_text_and_is_searched_by_its_symbol() -> None:
    query = OntologyQuery.model_validate_json('{"relatedTo": {"relation": "callers", "symbol": "pkg.run"}}')
    assert (query.listing, query.search_text) == (False, "pkg.run")
    both = OntologyQuery.model_validate_json(
        '{"semanticQuery": "x", "relatedTo": {"relation": "bases", "symbol": "C"}}'
    )
    assert both.search_text == "x"
    # In any script, as Python reads identifiers (a tenant tester's "café" was refused, though asked in words it was
    # found); full-width letters read as Python reads them.
    for written, read in (("café", "café"), ("数据.处理", "数据.处理"), ("ｒｕｎ", "run")):
        asked = OntologyQuery.model_validate({"relatedTo": {"relation": "callers", "symbol": written}})
        assert asked.related_to is not None
        assert asked.related_to.symbol == read


def test_a_request_with_nothing_to_search_or_list_by_names_every_filter_it_could_give() -> None:
    """A monorepo tester's: the error named four filters, and `paths` alone was a listing it did not name."""
    with pytest.raises(ValidationError) as refused:
        OntologyQuery.model_validate({"topK": 3})
    message = refused.value.errors()[0]["msg"]
    assert all(to_camel(name) in message for name in FILTERS), message
    assert "paths, excludePaths" in message  # the two the message left out
    assert OntologyQuery.model_validate({"paths": ["*"]}).listing


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


def test_the_committed_asyncapi_document_matches_the_contracts(tmp_path: Path) -> None:
    assert not asyncapi.drifted(), "regenerate with `ontofabric contracts --write`"
    stale = tmp_path / "asyncapi.json"
    stale.write_text(asyncapi.DOCUMENT_PATH.read_text().replace('"ontofabric.query.', '"ontofabric.ask.'))
    assert asyncapi.drifted(stale)


def test_the_asyncapi_examples_of_workspaces_and_branches_are_names_a_request_may_use() -> None:
    """A conformance tester's: the workspace example decoded to `team/search`, which no workspace may be named."""
    names = {"workspace": WORKSPACE, "branch": BRANCH}
    document = json.loads(asyncapi.DOCUMENT_PATH.read_text())
    for channel in document["channels"].values():
        for parameter, described in (channel.get("parameters") or {}).items():
            for example in described.get("examples", []) if parameter in names else []:
                names[parameter].validate_python(decode_token(example))


def _matches(address: str, subject: str) -> bool:
    """Whether a concrete subject is one of a channel address's (each ``{parameter}`` one or more tokens)."""
    pattern = re.escape(address)
    pattern = re.sub(r"\\\{[a-z]+\\\}", "[^ ]+", pattern)
    return re.fullmatch(pattern, subject) is not None


def test_every_subject_the_services_use_has_a_channel() -> None:
    document = json.loads(asyncapi.render())
    addresses = [channel["address"] for channel in document["channels"].values() if channel["address"]]
    names = Names()
    used = [
        names.delta_subject("acme", "feature/x.y"),
        f"{names.prefix}.published.acme.main",
        names.dlq_subject("acme"),
        names.version_event_subject("acme", "main"),
        f"$KV.{names.version_bucket}.{names.version_key('acme', 'main')}",
        f"$KV.{names.manifest_bucket}.acme.main.head",
        f"$O.{names.snapshot_bucket}.C.abc123",
        *(names.request_subject(operation, "acme") for operation in OPERATIONS),
    ]
    assert [subject for subject in used if not any(_matches(a, subject) for a in addresses)] == []
    # and the republish subject is the one the stream's configuration maps deltas to
    assert names.published_subjects == f"{names.prefix}.published.>"


@pytest.mark.parametrize(
    "body",
    [
        {"semanticQuery": None},
        {"semanticQuery": " \t"},
        {"semanticQuery": "\u0000abc"},
        {"chunkLevel": None},
        # Whitespace as the worker's str.strip() reads it, not as a regular expression's \s (a review's).
        {"semanticQuery": "\x1c\x85"},
        # Marks that show nothing were answered, dense alone, with whatever lay nearest (an outside tester's).
        {"semanticQuery": "\u200b\u200e\u2060"},
        {"semanticQuery": " \ufeff\u00ad\u202e "},
        # Hangul fillers, a variation selector, a grapheme joiner: shown as nothing too (a review's).
        {"semanticQuery": "\u3164\ufe0f\u034f\u115f"},
    ],
)
def test_what_the_worker_refuses_as_a_query_the_schema_refuses_too(body: dict[str, object]) -> None:
    """A conformance tester's: these were valid by the committed schema, and refused by the worker."""
    with pytest.raises(ValidationError):
        OntologyQuery.model_validate(body)
    published = json.loads((schema.SCHEMA_DIR / "ontology-query.schema.json").read_text())
    assert not jsonschema.Draft202012Validator(published).is_valid(body)
    assert jsonschema.Draft202012Validator(published).is_valid({**body, "semanticQuery": "parse a file"})


def test_what_the_projector_refuses_as_a_delta_the_schema_refuses_too() -> None:
    """A tester's TypeScript ingester, written from the schemas: a payload without its type and a vector of no
    named model passed ajv, and the projector dead-lettered the one and indexed the other unchecked (now unused)."""
    published = json.loads((schema.SCHEMA_DIR / "delta-envelope.schema.json").read_text())
    assert published["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    assert "discriminator" not in json.dumps(published)  # OpenAPI's, which strict validators refuse
    validator = jsonschema.Draft202012Validator(published)
    delta = factories.upsert("acme", factories.document("a", "alpha", embedding=factories.unit_vector("a")))
    good = json.loads(delta.model_dump_json())
    assert validator.is_valid(good)
    untyped = json.loads(json.dumps(good))
    del untyped["payload"]["type"]
    unnamed = json.loads(json.dumps(good))
    unnamed["payload"]["document"]["embeddingModel"] = None
    for refused in (untyped, unnamed):
        assert not validator.is_valid(refused)
    without_vectors = json.loads(json.dumps(unnamed))
    without_vectors["payload"]["document"]["embedding"] = None
    assert validator.is_valid(without_vectors)


def test_a_delta_and_a_query_validate_against_the_documents_schemas() -> None:
    document = json.loads(asyncapi.render())
    components = document["components"]

    def validator(message: str) -> jsonschema.Draft7Validator:
        payload = components["messages"][message]["payload"]
        return jsonschema.Draft7Validator({**payload, "components": components})

    delta = factories.upsert(
        "acme", factories.document("d1", "def parse(): ...", embedding=factories.unit_vector("d1"))
    )
    validator("DeltaEnvelope").validate(json.loads(delta.model_dump_json(by_alias=True, exclude_none=True)))
    validator("OntologyQuery").validate({"semanticQuery": "parse a file", "topK": 5})
    errors = list(validator("OntologyQuery").iter_errors({"semanticQuery": "x", "topK": "many"}))
    assert errors, "a wrong type must not validate"


def test_the_asyncapi_cli_finds_the_document_valid(tmp_path: Path) -> None:
    cli = Path(__file__).parent / "asyncapi" / "node_modules" / ".bin" / "asyncapi"
    if not cli.exists():
        if os.environ.get("ONTOFABRIC_TEST_REQUIRE_TOOLS"):
            pytest.fail("the AsyncAPI CLI is missing (npm install --prefix tests/asyncapi)")
        pytest.skip("the AsyncAPI CLI is not installed (npm install --prefix tests/asyncapi)")
    # CI=true and a config file of its own: the CLI neither reports usage nor writes to the home directory.
    env = {**os.environ, "CI": "true", "ASYNCAPI_METRICS_CONFIG_PATH": str(tmp_path / "analytics.json")}
    checked = subprocess.run(
        [str(cli), "validate", str(asyncapi.DOCUMENT_PATH), "--fail-severity", "warn"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr
    broken = tmp_path / "broken.json"
    document = json.loads(asyncapi.render())
    document["operations"]["publishDelta"]["action"] = "publish"  # AsyncAPI 2's word, not a 3.0 action
    broken.write_text(json.dumps(document))
    refused = subprocess.run(
        [str(cli), "validate", str(broken), "--fail-severity", "warn"], capture_output=True, text=True, env=env
    )
    assert refused.returncode != 0, refused.stdout


@pytest.mark.parametrize(
    ("node", "taken"),
    [
        ({"name": "Widget", "kind": "class"}, True),
        ({"domain": "pkg", "name": "1Widget", "kind": "class"}, True),  # pkg.1Widget is an object type
        ({"domain": "", "name": "_private", "kind": "class"}, True),
        ({"name": "my widget", "kind": "class"}, False),
        ({"name": "1Widget", "kind": "class"}, False),  # the name alone is the object type
        ({"domain": "", "name": "1Widget", "kind": "class"}, False),
        ({"domain": "my pkg", "name": "Widget", "kind": "class"}, False),
        ({"domain": ".pkg", "name": "Widget", "kind": "class"}, False),
    ],
)
def test_the_schema_and_the_projector_agree_on_a_graph_nodes_names(node: dict[str, str], taken: bool) -> None:
    """A contract tester's nodes valid by the published schema (a name with a space, a top-level name starting with
    a digit) were dead-lettered: the object type's rule was the projector's alone."""
    envelope = json.loads(factories.upsert("acme", factories.document("a", "alpha")).model_dump_json())
    delta = {**envelope, "payload": {"type": "node.upserted", "node": node}}
    assert _taken_alike("delta-envelope", DeltaEnvelope, delta) is taken


def _taken_alike(schema_name: str, model: type[BaseModel], body: dict[str, Any]) -> bool:
    """Whether the published schema ``schema_name`` takes ``body``, checked to be what ``model`` says too."""
    published = json.loads((schema.SCHEMA_DIR / f"{schema_name}.schema.json").read_text())
    by_schema = jsonschema.Draft202012Validator(published).is_valid(body)
    try:
        model.model_validate_json(json.dumps(body))
    except ValidationError:
        by_model = False
    else:
        by_model = True
    assert by_schema == by_model, (body, by_schema, by_model)
    return by_schema


def test_the_schema_refuses_an_empty_path_pattern_as_the_worker_does() -> None:
    """A contract tester's ``paths: [""]``: valid by the schema, refused by the worker."""
    published = json.loads((schema.SCHEMA_DIR / "ontology-query.schema.json").read_text())
    validator = jsonschema.Draft202012Validator(published)
    for field in ("paths", "excludePaths"):
        for patterns, taken in (([""], False), (["x" * 513], False), (["services/query"], True)):
            body = {"semanticQuery": "parse a file", field: patterns}
            assert validator.is_valid(body) is taken, body
            if not taken:
                with pytest.raises(ValidationError):
                    OntologyQuery.model_validate(body)


@pytest.mark.parametrize(
    ("lines", "taken"),
    [
        ({"startLine": 3, "endLine": 5}, True),
        ({"startLine": 3}, True),
        ({"endLine": None}, True),  # applied, and refused by the schema's dependentRequired before
        ({"startLine": None, "endLine": None}, True),
        ({"endLine": 5}, False),
        ({"startLine": None, "endLine": 5}, False),
    ],
)
def test_the_schema_and_the_projector_agree_on_a_documents_lines(lines: dict[str, int | None], taken: bool) -> None:
    delta = json.loads(factories.upsert("acme", factories.document("a", "alpha")).model_dump_json())
    metadata = delta["payload"]["document"]["metadata"]
    for key in ("startLine", "endLine"):
        metadata.pop(key, None)
    metadata.update(lines)
    assert _taken_alike("delta-envelope", DeltaEnvelope, delta) is taken


@pytest.mark.parametrize(
    ("symbol", "taken"),
    [
        ("client.auth-extensions", True),
        ("lib.rfc-2616", True),  # digits after a hyphen: a module of rfc-2616.js (a review's, refused by the model)
        ("base-64", True),
        ("-x", False),
        ("x-", False),
        ("a--b", False),
        ("2fa.x", False),
        ("src/clock.rs", False),
    ],
)
def test_a_relations_symbol_the_schema_takes_the_model_takes(symbol: str, taken: bool) -> None:
    body = {"relatedTo": {"relation": "importers", "symbol": symbol}}
    assert _taken_alike("ontology-query", OntologyQuery, body) is taken


def test_a_relations_symbol_refused_says_what_is_wrong_in_words() -> None:
    """An agent tester's ``src/clock.rs`` got the schema's pattern back, cut short at 200 characters."""
    refused = read_request(OntologyQuery, b'{"relatedTo": {"relation": "importers", "symbol": "src/clock.rs"}}')
    assert isinstance(refused, QueryError)
    (detail,) = refused.details
    assert detail.field == "relatedTo.symbol"
    assert "pattern" not in detail.message
    assert "src/clock.rs is src.clock" in detail.message


def test_a_relation_names_any_identifier_python_reads() -> None:
    """A Unicode tester's ``subclasses नमस्ते`` was refused as no name: ``\\w`` leaves out combining marks."""
    from ontofabric.contracts.query import RelatedTo

    for name in ("नमस्ते", "beyond.marks.สวัสดี", "كَتَبَ", "x‿y", "℘eier", "client.auth-extensions", "$query", "a.$b"):
        assert RelatedTo(relation="subclasses", symbol=name).symbol == name
    for name in ("a b", "1abc", "x.", "a/b"):
        with pytest.raises(ValidationError):
            RelatedTo(relation="subclasses", symbol=name)


def test_an_object_type_asked_for_is_read_as_object_types_are_written() -> None:
    """A retest's objectType filter typed with a decomposed accent found none of the type's results: object types are
    written in NFKC, part by part."""
    from ontofabric.contracts.query import OntologyQuery

    asked = OntologyQuery.model_validate({"semanticQuery": "x", "objectType": "tsmod.mo\u0301dulo.Basis"})
    assert asked.object_type == "tsmod.m\u00f3dulo.Basis"
    assert OntologyQuery.model_validate({"semanticQuery": "x", "objectType": "a.b"}).object_type == "a.b"
    # Kept as asked where its form would be no object type (a review's notes⑴ became notes(1), then refused).
    kept = OntologyQuery.model_validate({"semanticQuery": "x", "objectType": "docs.notes\u2474"})
    assert kept.object_type == "docs.notes\u2474"
    assert OntologyQuery.model_validate(kept.model_dump(by_alias=True)).object_type == "docs.notes\u2474"
