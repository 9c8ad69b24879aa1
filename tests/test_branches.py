"""Graph narrowing, 1-hop expansion and the main ⊕ branch overlay, end to end against the real servers."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import pytest

from ontofabric.contracts import (
    DeltaEnvelope,
    DocumentReverted,
    LinkAdded,
    LinkRemoved,
    NodeUpserted,
    OntologyLink,
    OntologyNode,
    OntologyQuery,
    QueryResponse,
)
from ontofabric.contracts.query import RelationAsked
from ontofabric.services.gateway.tools import answer_notes
from ontofabric.services.ingest.client import envelope
from ontofabric.services.ingest.ingester import Ingester, Manifest
from ontofabric.services.projector.worker import ProjectorService
from ontofabric.services.query.client import QueryClient
from ontofabric.services.query.worker import QueryService
from ontofabric.shared.embedder import Embedder

from .conftest import Deployment
from .factories import delete, document, upsert
from .test_pipeline import ScriptedRetrieval, pipeline_over


@pytest.fixture
async def worker(deployment: Deployment, projector: ProjectorService, embedder: Embedder) -> AsyncIterator[QueryClient]:
    settings = deployment.settings.model_copy(update={"query_cache_entries": 0})  # every answer read fresh
    service = QueryService(settings, deployment.nats_url_as("query"), deployment.database_url, embedder)
    await service.start()
    yield QueryClient(deployment.nc, deployment.names)
    await service.stop()


def _doc(
    embedder: Embedder, doc_id: str, content: str, object_type: str, level: str = "method", key: str = ""
) -> object:
    vector = [float(x) for x in embedder.embed_documents([content])[0]]
    extra = {"symbolKey": key} if key else {}
    return document(doc_id, content, object_type=object_type, chunk_level=level, embedding=vector, **extra)


async def _publish(deployment: Deployment, deltas: Sequence[DeltaEnvelope]) -> None:
    acks = await deployment.publisher.publish_many(deltas)
    await deployment.wait_projected(acks[-1].seq)


async def _ask(client: QueryClient, text: str, **params: object) -> QueryResponse:
    reply = await client.query("acme", {"semanticQuery": text, "topK": 20, "precision": False, **params})
    assert isinstance(reply, QueryResponse), reply
    return reply


async def _ingested(deployment: Deployment, ingester: Ingester, tree: Path, branch: str = "main") -> None:
    result = await ingester.ingest(tree, "acme", branch)
    if result.last_sequence is not None:
        await deployment.wait_projected(result.last_sequence)


async def _places(worker: QueryClient, branch: str) -> dict[str, tuple[object, object]]:
    """Each method's qualified name, with its lines, as the branch shows them."""
    reply = await _ask(worker, "return", branch=branch, chunkLevel="method")
    return {r.metadata["symbolFqn"]: (r.metadata.get("startLine"), r.metadata.get("endLine")) for r in reply.results}


def _node(object_type: str, *interfaces: str, branch: str = "main") -> DeltaEnvelope:
    domain, _, name = object_type.rpartition(".")
    node = OntologyNode(domain=domain, name=name, kind="class", interfaces=list(interfaces))
    return envelope("acme", NodeUpserted(node=node), branch=branch)


def _link(source: str, name: str, target: str, branch: str = "main", removed: bool = False) -> DeltaEnvelope:
    link = OntologyLink(source_type=source, name=name, target_type=target)
    return envelope("acme", LinkRemoved(link=link) if removed else LinkAdded(link=link), branch=branch)


async def test_a_subtype_is_found_through_its_interface(
    deployment: Deployment, embedder: Embedder, worker: QueryClient
) -> None:
    await _publish(
        deployment,
        [
            _node("shop.Repository"),
            _node("shop.OrderRepository", "shop.Repository"),
            _node("shop.CachedOrders", "shop.OrderRepository"),
            _node("shop.Unrelated"),
            upsert("acme", _doc(embedder, "base", "save an item in the repository", "shop.Repository")),
            upsert("acme", _doc(embedder, "impl", "save an order in the repository", "shop.OrderRepository")),
            upsert("acme", _doc(embedder, "deep", "save cached orders in the repository", "shop.CachedOrders")),
            upsert("acme", _doc(embedder, "other", "save a picture in the repository", "shop.Unrelated")),
        ],
    )
    reply = await _ask(worker, "save in the repository", objectType="shop.Repository")
    assert {r.id for r in reply.results} == {"base", "impl", "deep"}
    assert {f.retriever for r in reply.results for f in r.found_by} == {"dense", "keyword"}
    exact = await _ask(worker, "save in the repository", objectType="shop.CachedOrders")
    assert [r.id for r in exact.results] == ["deep"]


async def test_expansion_attaches_one_representative_per_linked_type(
    deployment: Deployment, embedder: Embedder, worker: QueryClient
) -> None:
    await _publish(
        deployment,
        [
            _node("app.Checkout"),
            _node("app.Cart"),
            _node("app.Prices"),
            _node("app.Audit"),
            _link("app.Checkout", "calls", "app.Prices"),
            _link("app.Cart", "calls", "app.Prices"),
            _link("app.Audit", "imports", "app.Checkout"),
            _link("app.Checkout", "calls", "app.Ghost"),  # a linked type nothing is indexed for
            _link("app.Checkout", "imports", "app.util"),
            _link("app.Checkout", "documentedBy", "app.Guide"),
            _link("app.Checkout", "documentedBy", "app.Notes"),
            upsert("acme", _doc(embedder, "checkout", "checkout pays for the cart", "app.Checkout")),
            upsert("acme", _doc(embedder, "cart", "cart holds items to pay for", "app.Cart")),
            upsert("acme", _doc(embedder, "prices-type", "class Prices: price list", "app.Prices", "type")),
            upsert("acme", _doc(embedder, "prices-method", "def price(item): look up", "app.Prices")),
            upsert("acme", _doc(embedder, "audit", "audit trail of payments", "app.Audit", "method")),
            upsert("acme", _doc(embedder, "util-a", "def a(): helper", "app.util", "method")),
            upsert("acme", _doc(embedder, "util-file", "helpers for the shop", "app.util", "file")),
            upsert("acme", _doc(embedder, "guide", "style rules for the wiki pages", "app.Guide", "doc")),
            upsert("acme", document("notes", "release notes", object_type="app.Notes", chunk_level=None)),  # no level
        ],
    )
    plain = await _ask(worker, "pay for the cart", topK=2)
    assert plain.meta.expanded_context == []
    reply = await _ask(worker, "pay for the cart", topK=2, followLinks=True)
    assert {r.id for r in reply.results} == {"checkout", "cart"}
    context = {c.linked_type: c for c in reply.meta.expanded_context}
    # Prices once, though linked twice
    assert set(context) == {"app.Prices", "app.Audit", "app.Ghost", "app.util", "app.Guide", "app.Notes"}
    assert context["app.Prices"].representative_document_id == "prices-type"  # a type chunk before a method one
    assert context["app.Prices"].link_name == "calls"
    assert context["app.Audit"].direction == "incoming"
    assert context["app.Audit"].representative_document_id == "audit"
    assert context["app.Ghost"].representative_document_id is None  # the node appears, with no chunk
    # A module by its file, as a relation lookup answers for it, not by whichever of its functions sorts first.
    assert context["app.util"].representative_document_id == "util-file"
    assert context["app.Guide"].representative_document_id == "guide"  # a producer's prose stands for its type
    assert context["app.Notes"].representative_document_id == "notes"
    assert [r.id for r in reply.results] == [r.id for r in plain.results]  # context never re-ranks
    assert "expansion" in reply.meta.timings_ms


async def test_a_rename_on_a_branch_is_seen_from_main_and_from_the_branch(
    deployment: Deployment, embedder: Embedder, worker: QueryClient
) -> None:
    await _publish(
        deployment, [upsert("acme", _doc(embedder, "old", "compute the invoice total", "b.Billing", key="k:old"))]
    )
    await _publish(
        deployment,
        [
            delete("acme", "old", branch="feature/rename"),
            upsert(
                "acme",
                _doc(embedder, "new", "compute the invoice total", "b.Billing", key="k:new"),
                branch="feature/rename",
            ),
        ],
    )
    on_main = await _ask(worker, "invoice total")
    on_branch = await _ask(worker, "invoice total", branch="feature/rename")
    assert [r.id for r in on_main.results] == ["old"]
    assert [r.id for r in on_branch.results] == ["new"]
    assert on_branch.meta.ontology_version.startswith(on_main.meta.ontology_version + "+")


async def test_branch_versions_shadow_main_by_symbol_key_and_branches_stay_apart(
    deployment: Deployment, embedder: Embedder, worker: QueryClient
) -> None:
    await _publish(
        deployment,
        [
            upsert("acme", _doc(embedder, "m-tax", "alpha tax rules", "t.Tax", key="k:tax")),
            upsert("acme", _doc(embedder, "m-keep", "alpha shipping rules", "t.Ship", key="k:ship")),
        ],
    )
    await _publish(
        deployment,
        [
            # Another id, the same symbol: the branch's version replaces main's on the branch.
            upsert("acme", _doc(embedder, "b-tax", "beta tax rules", "t.Tax", key="k:tax"), branch="one"),
            delete("acme", "m-keep", branch="one"),  # the branch deletes a document main still has
            upsert("acme", _doc(embedder, "two-only", "gamma rules", "t.Other", key="k:two"), branch="two"),
        ],
    )
    for retrievers in (["keyword"], ["dense"], ["dense", "keyword"]):
        options = {"options": {"retrievers": retrievers}}
        main = {r.id for r in (await _ask(worker, "alpha beta gamma tax shipping rules", **options)).results}
        one = {
            r.id for r in (await _ask(worker, "alpha beta gamma tax shipping rules", branch="one", **options)).results
        }
        two = {
            r.id for r in (await _ask(worker, "alpha beta gamma tax shipping rules", branch="two", **options)).results
        }
        assert main == {"m-tax", "m-keep"}, retrievers
        assert one == {"b-tax"}, retrievers
        assert two == {"m-tax", "m-keep", "two-only"}, retrievers
    shadowed = await _ask(worker, "alpha", branch="one", options={"retrievers": ["keyword"]})
    assert [r.id for r in shadowed.results] == []  # main's alpha document is hidden by the branch's version


async def test_a_revert_lets_main_show_through_again(
    deployment: Deployment, embedder: Embedder, worker: QueryClient
) -> None:
    await _publish(deployment, [upsert("acme", _doc(embedder, "doc", "original text", "r.T", key="k:doc"))])
    await _publish(deployment, [upsert("acme", _doc(embedder, "doc", "branch text", "r.T", key="k:doc"), branch="b")])
    changed = await _ask(worker, "text", branch="b")
    assert [r.content for r in changed.results] == ["branch text"]
    await _publish(deployment, [envelope("acme", DocumentReverted(document_id="doc"), branch="b")])
    reverted = await _ask(worker, "text", branch="b")
    assert [r.content for r in reverted.results] == ["original text"]


async def test_branch_graph_changes_overlay_main(
    deployment: Deployment, embedder: Embedder, worker: QueryClient
) -> None:
    await _publish(
        deployment,
        [
            _node("g.A"),
            _node("g.B"),
            _node("g.C"),
            _link("g.A", "calls", "g.B"),
            upsert("acme", _doc(embedder, "a", "alpha component", "g.A")),
        ],
    )
    await _publish(
        deployment, [_link("g.A", "calls", "g.B", branch="x", removed=True), _link("g.A", "calls", "g.C", branch="x")]
    )
    main = await _ask(worker, "alpha component", followLinks=True)
    branch = await _ask(worker, "alpha component", followLinks=True, branch="x")
    assert [c.linked_type for c in main.meta.expanded_context] == ["g.B"]
    assert [c.linked_type for c in branch.meta.expanded_context] == ["g.C"]


class BrokenGraph(ScriptedRetrieval):
    async def graph_rows(self, workspace: str, branch: str) -> object:  # type: ignore[override]
        raise ConnectionError("graph tables unreachable")


async def test_a_failing_expansion_degrades_and_results_still_return() -> None:
    pipeline = pipeline_over(BrokenGraph())
    reply = await pipeline.answer(OntologyQuery(semantic_query="anything", follow_links=True), "w")
    assert reply.meta.degraded == ["graphExpansion"]
    assert reply.results
    narrowed = await pipeline.answer(OntologyQuery(semantic_query="anything", object_type="t.T"), "w")
    assert narrowed.meta.degraded == ["objectTypeNarrowing"]


async def test_a_branch_keeps_its_version_of_a_file_it_changed_when_main_changes_that_file_later(
    deployment: Deployment, worker: QueryClient, tmp_path: Path
) -> None:
    """An outside tester's: the branch held only the chunks it changed, so the others of that file came from main
    as main was later. After main added lines at the top, the branch's unchanged function stated main's lines;
    main's new function showed on the branch; main deleting the file took the branch's unchanged function too."""
    tree = tmp_path / "tree"
    tree.mkdir()
    (tree / "a.py").write_text("def alpha():\n    return 1\n\n\ndef beta():\n    return 2\n")
    (tree / "gone.py").write_text("def gamma():\n    return 3\n")
    ingester = Ingester(deployment.js, deployment.names, None, deployment.settings.max_content_bytes)

    await _ingested(deployment, ingester, tree)
    (tree / "a.py").write_text("def alpha():\n    return 1\n\n\ndef beta():\n    return 22\n")
    (tree / "gone.py").unlink()
    await _ingested(deployment, ingester, tree, "feat")
    (tree / "gone.py").write_text("def gamma():\n    return 3\n\n\ndef delta_gone():\n    return 5\n")
    # The branch holds all of a.py, though alpha is as main has it: 3 documents, not 2.
    rows = await deployment.fetch("SELECT count(*) AS n FROM documents WHERE branch = 'feat' AND NOT deleted")
    assert rows[0]["n"] == 3
    (tree / "a.py").write_text("# one\n# two\n\ndef alpha():\n    return 1\n\n\ndef beta():\n    return 2\n\n\n"
                               "def delta():\n    return 4\n")  # fmt: skip
    await _ingested(deployment, ingester, tree)
    assert await _places(worker, "main") == {
        "a.alpha": (4, 5), "a.beta": (8, 9), "a.delta": (12, 13), "gone.gamma": (1, 2), "gone.delta_gone": (5, 6),
    }  # fmt: skip
    # The branch's a.py, none of main's; and nothing of gone.py, which it deleted, though main added to it.
    assert await _places(worker, "feat") == {"a.alpha": (1, 2), "a.beta": (5, 6)}
    (tree / "a.py").unlink()
    (tree / "other.py").write_text("X = 1\n")
    await _ingested(deployment, ingester, tree)
    assert await _places(worker, "main") == {"gone.gamma": (1, 2), "gone.delta_gone": (5, 6)}
    assert await _places(worker, "feat") == {"a.alpha": (1, 2), "a.beta": (5, 6)}


async def test_a_branchs_graph_of_a_file_it_changed_or_deleted_keeps_mains_later_changes_out(
    deployment: Deployment, worker: QueryClient, tmp_path: Path
) -> None:
    """An outside tester's: a branch's graph held only the nodes and links that differed from main's when it was
    ingested, so main's later bases and imports in a file the branch changed or deleted showed on the branch, and
    main's later removals took the branch's unchanged ones with them."""
    tree = tmp_path / "tree"
    tree.mkdir()
    (tree / "base.py").write_text("class Base:\n    pass\n\n\nclass Other:\n    pass\n")
    (tree / "extra.py").write_text("X = 1\n")
    (tree / "kinds.py").write_text(
        "import extra\nfrom base import Base\n\n\nclass Kept(Base):\n    pass\n\n\nclass Edited(Base):\n    pass\n"
    )
    (tree / "gone.py").write_text("from base import Base\n\n\nclass Dropped(Base):\n    pass\n")
    ingester = Ingester(deployment.js, deployment.names, None, deployment.settings.max_content_bytes)

    async def related(relation: str, branch: str, symbol: str = "Base") -> set[str]:
        reply = await worker.query(
            "acme", {"relatedTo": {"relation": relation, "symbol": symbol}, "branch": branch, "topK": 20}
        )
        assert isinstance(reply, QueryResponse), reply
        relations = {"subclass", "base", "importer", "imported"}
        return {r.metadata["symbolFqn"] for r in reply.results if relations & {f.retriever for f in r.found_by}}

    await _ingested(deployment, ingester, tree)
    (tree / "kinds.py").write_text(
        "import extra\nfrom base import Base\n\n\nclass Kept(Base):\n    pass\n\n\nclass Edited(Base):\n    x = 2\n"
    )
    (tree / "gone.py").unlink()
    await _ingested(deployment, ingester, tree, "feat")
    assert await related("subclasses", "feat") == {"kinds.Kept", "kinds.Edited"}
    # Main, later: Kept no longer derives from Base, a new subclass and an import in kinds.py; gone.py grows one.
    (tree / "kinds.py").write_text(
        "from base import Base, Other\n\n\nclass Kept(Other):\n    pass\n\n\nclass Edited(Base):\n    pass\n\n\n"
        "class Later(Base):\n    pass\n"
    )
    (tree / "gone.py").write_text(
        "from base import Base\n\n\nclass Dropped(Base):\n    pass\n\n\nclass More(Base):\n    pass\n"
    )
    await _ingested(deployment, ingester, tree)
    assert await related("subclasses", "main") == {"kinds.Edited", "kinds.Later", "gone.Dropped", "gone.More"}
    assert await related("subclasses", "feat") == {"kinds.Kept", "kinds.Edited"}
    assert await related("imports", "feat", "kinds") == {"base", "extra"}
    # A class the branch deleted (with gone.py): main defines it, which the answer says, not a misspelling.
    asked = {"relatedTo": {"relation": "subclasses", "symbol": "Dropped"}, "topK": 20}
    deleted = await worker.query("acme", {**asked, "branch": "feat"})
    on_main = await worker.query("acme", asked)
    assert isinstance(deleted, QueryResponse)
    assert isinstance(on_main, QueryResponse)
    assert deleted.meta.relation is not None
    assert (deleted.meta.relation.symbol_indexed, deleted.meta.relation.defined_on_main) == (False, True)
    assert on_main.meta.relation is not None
    assert (on_main.meta.relation.symbol_indexed, on_main.meta.relation.defined_on_main) == (True, None)


async def test_a_file_only_calling_what_a_branch_moved_follows_main(
    deployment: Deployment, worker: QueryClient, tmp_path: Path
) -> None:
    """An outside tester's: moving a function on a branch changed the calls of the chunks calling it, and each of
    their files was taken whole: main's later changes to those files, whose text the branch never changed,
    stopped showing on the branch."""
    tree = tmp_path / "tree"
    tree.mkdir()
    calling = "import u\n\n\ndef g():\n    return u.f()\n\n\ndef h():\n    return 2\n"
    (tree / "u.py").write_text("def f():\n    return 1\n")
    (tree / "n.py").write_text("X = 1\n")
    (tree / "w.py").write_text(calling)
    ingester = Ingester(deployment.js, deployment.names, None, deployment.settings.max_content_bytes)

    await _ingested(deployment, ingester, tree)
    (tree / "u.py").write_text("from n import f\n")
    (tree / "n.py").write_text("X = 1\n\n\ndef f():\n    return 1\n")
    await _ingested(deployment, ingester, tree, "feat")
    rows = await deployment.fetch(
        "SELECT symbol_fqn, metadata -> 'calls' AS calls, metadata ? 'wholeFile' AS whole FROM documents"
        " WHERE branch = 'feat' AND file_path = 'w.py'"
    )
    assert [(r["symbol_fqn"], r["calls"], r["whole"]) for r in rows] == [("w.g", '["n.f"]', False)]
    (tree / "w.py").write_text(f"# main, later\n{calling}\n\ndef k():\n    return 3\n")
    await _ingested(deployment, ingester, tree)
    # Main's later w.py shows on the branch: k, and h where main has it; g is the branch's (its calls, its lines).
    assert await _places(worker, "feat") == {"n.f": (4, 5), "w.g": (4, 5), "w.h": (9, 10), "w.k": (13, 14)}


async def test_a_name_or_path_the_branch_deleted_is_said_to_be_indexed_on_main(
    deployment: Deployment, worker: QueryClient, tmp_path: Path
) -> None:
    """An agent tester's: a symbol's name or a file's path the branch deleted got "not indexed", said as of a
    misspelt one, though main still held it."""
    tree = tmp_path / "tree"
    tree.mkdir()
    (tree / "kept.py").write_text("def kept_function():\n    return 1\n")
    (tree / "gone.py").write_text("class GoneWidget:\n    pass\n")
    ingester = Ingester(deployment.js, deployment.names, None, deployment.settings.max_content_bytes)
    await _ingested(deployment, ingester, tree)
    (tree / "gone.py").unlink()
    await _ingested(deployment, ingester, tree, "feat")
    for text in ("GoneWidget", "gone.py"):
        on_branch = await _ask(worker, text, branch="feat")
        assert (on_branch.meta.exact_symbol_matches, on_branch.meta.indexed_on_main) == (0, True), text
        notes = answer_notes(on_branch, {"semanticQuery": text, "branch": "feat"})
        assert any("though main indexes one: the branch's files hold none (deleted, renamed" in note for note in notes)
        on_main = await _ask(worker, text)
        assert (on_main.meta.exact_symbol_matches, on_main.meta.indexed_on_main) == (1, None), text
    for text in ("kept_function", "kept.py", "NoSuchWidget", "nowhere.py"):  # held by the branch, or by neither
        assert (await _ask(worker, text, branch="feat")).meta.indexed_on_main is None, text
    # Within the filters: main's class is no method, so nothing is said of main.
    assert (await _ask(worker, "GoneWidget", branch="feat", chunkLevel="method")).meta.indexed_on_main is None


async def test_the_callers_of_what_a_branch_deleted_are_its_code_still_calling_mains(
    deployment: Deployment, worker: QueryClient, tmp_path: Path
) -> None:
    """Note 90's: on a branch that deleted or renamed a function, "what calls it" found nothing, though the
    branch's code still called it: in files it left unchanged (main's chunks, whose calls name main's function) and
    in files it changed (whose calls an ingest resolved within the branch's tree, where the name is gone)."""
    tree = tmp_path / "tree"
    tree.mkdir()
    (tree / "u.py").write_text(
        "def f():\n    return 1\n\n\ndef other():\n    return 2\n\n\nclass Foo:\n    def __init__(self):\n"
        "        pass\n"
    )
    (tree / "w.py").write_text("import u\n\n\ndef g():\n    return u.f()\n\n\ndef mk():\n    return u.Foo()\n")
    (tree / "x.py").write_text("from u import f\n\n\ndef caller():\n    return f()\n")
    (tree / "pkg").mkdir()
    (tree / "pkg" / "__init__.py").write_text("")
    (tree / "pkg" / "old.py").write_text("def h():\n    return 3\n")
    (tree / "y.py").write_text("from pkg.old import h\n\n\ndef k():\n    return h()\n")
    ingester = Ingester(deployment.js, deployment.names, None, deployment.settings.max_content_bytes)

    async def callers(branch: str, symbol: str = "f") -> tuple[set[str], RelationAsked | None]:
        asked = {"relatedTo": {"relation": "callers", "symbol": symbol}, "branch": branch, "topK": 20}
        reply = await worker.query("acme", asked)
        assert isinstance(reply, QueryResponse), reply
        found = {r.metadata["symbolFqn"] for r in reply.results if "caller" in {f.retriever for f in r.found_by}}
        return found, reply.meta.relation

    await _ingested(deployment, ingester, tree)
    (tree / "u.py").write_text("def f_renamed():\n    return 1\n\n\ndef other():\n    return 2\n")
    (tree / "x.py").write_text("from u import f\n\n\ndef caller():\n    return f() + 1\n")
    (tree / "pkg" / "old.py").rename(tree / "pkg" / "new.py")  # moved, y.py unchanged
    await _ingested(deployment, ingester, tree, "feat")
    rows = await deployment.fetch(
        "SELECT symbol_fqn, metadata -> 'calls' AS calls FROM documents WHERE branch = 'feat' AND file_path = 'x.py'"
        " AND symbol_fqn = 'x.caller'"
    )
    assert [r["calls"] for r in rows] == ['["u.f"]']  # unbound in the branch's tree, kept
    for symbol in ("f", "u.f"):
        found, relation = await callers("feat", symbol)
        assert found == {"w.g", "x.caller"}, symbol
        assert relation is not None
        assert (relation.symbol_indexed, relation.defined_on_main) == (False, True)
    found, relation = await callers("main")
    assert found == {"w.g", "x.caller"}
    assert relation is not None
    assert (relation.symbol_indexed, relation.defined_on_main) == (True, None)
    # A class's constructor the branch deleted with its class: the class's callers (a review's).
    assert (await callers("feat", "Foo.__init__"))[0] == {"w.mk"}
    # A function whose module the branch moved, asked by its qualified name (the branch defines h elsewhere).
    found, relation = await callers("feat", "pkg.old.h")
    assert found == {"y.k"}
    assert relation is not None
    assert (relation.symbol_indexed, relation.defined_on_main) == (False, True)
    # And the module's importers: y.py, unchanged, still imports it (an agent tester's moved module lost them all).
    asked = {"relatedTo": {"relation": "importers", "symbol": "pkg.old"}, "branch": "feat", "topK": 20}
    importers = await worker.query("acme", asked)
    assert isinstance(importers, QueryResponse), importers
    assert {r.metadata["symbolFqn"] for r in importers.results if "importer" in {f.retriever for f in r.found_by}} == {
        "y"
    }
    # The renamed function on the branch: nobody calls it there yet.
    found, relation = await callers("feat", "f_renamed")
    assert found == set()
    assert relation is not None
    assert (relation.symbol_indexed, relation.defined_on_main) == (True, None)


async def test_a_branch_that_took_a_section_out_of_a_file_or_deleted_it_keeps_mains_later_changes_out(
    deployment: Deployment, worker: QueryClient, tmp_path: Path
) -> None:
    """Note 77's: a file the branch changed only by taking its last section out was not held whole, and a
    Markdown file it deleted had no module whose tombstone said so: main's later sections showed on the branch."""
    tree = tmp_path / "tree"
    tree.mkdir()
    guide = "# Guide\n\nguide steps\n\n## Install\n\ninstall steps\n\n## Remove\n\nremove steps\n"
    (tree / "guide.md").write_text(guide)
    (tree / "notes.md").write_text("# Notes\n\nnote steps\n")
    ingester = Ingester(deployment.js, deployment.names, None, deployment.settings.max_content_bytes)

    async def sections(branch: str) -> dict[str, object]:
        reply = await _ask(worker, "steps", branch=branch)
        return {r.metadata["symbolFqn"]: r.metadata.get("startLine") for r in reply.results}

    await _ingested(deployment, ingester, tree)
    # Main's manifest as an earlier release saved it, without the documents' files: an ingest that sends nothing
    # records them, so that the branch can tell which files it changed.
    loaded = await ingester._manifests.load("acme", "main")
    recorded = Manifest.from_json(loaded.data or b"")
    await ingester._manifests.save("acme", "main", Manifest(recorded.entries, recorded.exclude).to_json(), loaded)
    assert (await ingester.load_manifest("acme", "main")).files == {}
    await _ingested(deployment, ingester, tree)
    assert (await ingester.load_manifest("acme", "main")).files == recorded.files != {}
    (tree / "guide.md").write_text(guide.split("## Remove")[0])
    (tree / "notes.md").unlink()
    await _ingested(deployment, ingester, tree, "feat")
    (tree / "guide.md").write_text("# Guide\n\nintro\n\nguide steps\n\n## Install\n\ninstall steps\n\n## Remove\n\n"
                                   "remove steps\n\n## Upgrade\n\nupgrade steps\n")  # fmt: skip
    (tree / "notes.md").write_text("# Notes\n\nnote steps\n\n## More\n\nmore steps\n")
    await _ingested(deployment, ingester, tree)
    assert await sections("main") == {
        "guide.md > Guide": 1, "guide.md > Guide > Install": 7, "guide.md > Guide > Remove": 11,
        "guide.md > Guide > Upgrade": 15, "notes.md > Notes": 1, "notes.md > Notes > More": 5,
    }  # fmt: skip
    assert await sections("feat") == {"guide.md > Guide": 1, "guide.md > Guide > Install": 5}
    # The branch takes notes.md back, changed: its own, and main's section it never had is hidden no more
    # than any other of main's documents of a file the branch holds.
    (tree / "notes.md").write_text("# Notes\n\nnote steps, the branch's\n")
    (tree / "guide.md").write_text(guide.split("## Remove")[0])
    await _ingested(deployment, ingester, tree, "feat")
    assert await sections("feat") == {
        "guide.md > Guide": 1, "guide.md > Guide > Install": 5, "notes.md > Notes": 1,
    }  # fmt: skip


async def test_a_branch_document_hides_mains_of_its_file_only_when_its_producer_says_it_holds_the_whole_file(
    deployment: Deployment, worker: QueryClient
) -> None:
    """A review's: hiding by file for every branch document took main's other chunks of the file away from a
    producer that sends only the chunks it changes, and from branches ingested before the mark existed."""
    await _publish(
        deployment,
        [upsert("acme", document(name, f"parse the {name} record", filePath="f.py")) for name in ("one", "two")],
    )
    changed = document("one", "parse the one record again", filePath="f.py")
    await _publish(deployment, [upsert("acme", changed, branch="partial")])
    partial = await _ask(worker, "parse record", branch="partial")
    assert sorted(r.id for r in partial.results) == ["one", "two"]  # two is main's, shown through
    whole = document("one", "parse the one record again", filePath="f.py", wholeFile=True)
    await _publish(deployment, [upsert("acme", whole, branch="whole")])
    held = await _ask(worker, "parse record", branch="whole")
    assert [r.id for r in held.results] == ["one"]  # the branch's f.py has no two
