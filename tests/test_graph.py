"""The ontology graph: extraction from Python sources, main ⊕ branch overlay, subtypes, 1-hop expansion, and
the per-version graph cache (pure)."""

from __future__ import annotations

import dataclasses
import textwrap
import time
from collections.abc import Mapping
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from ontofabric.services.ingest.graph import GraphLink, python_graph
from ontofabric.services.ingest.ingester import chunk_sources
from ontofabric.services.query.graph import (
    GraphCache,
    GraphRows,
    LinkRow,
    NodeRow,
    OntologyGraph,
    defining_module,
    expand,
    overlay,
)

SOURCES = {
    "shop/__init__.py": "",
    "shop/base.py": textwrap.dedent(
        """
        class Repository:
            def save(self, item):
                raise NotImplementedError
        """
    ),
    "shop/orders.py": textwrap.dedent(
        """
        from .base import Repository
        from . import pricing
        import shop.tax as tax

        class OrderRepository(Repository):
            def total(self, order):
                return pricing.price(order) + tax.vat(order)

        class CachedOrders(OrderRepository):
            pass

        def make():
            return OrderRepository()
        """
    ),
    "shop/pricing.py": "def price(order):\n    return 1\n",
    "shop/tax.py": "from ontofabric.shop.pricing import price\n\ndef vat(order):\n    return price(order) * 0.2\n",
}


def test_python_graph_nodes_and_links() -> None:
    nodes, links = python_graph(SOURCES)
    by_type = {n.object_type: n for n in nodes}
    assert by_type["shop.orders"].kind == "module"
    assert by_type["shop.orders.OrderRepository"].kind == "class"
    assert by_type["shop.orders.OrderRepository"].interfaces == ("shop.base.Repository",)
    assert by_type["shop.orders.CachedOrders"].interfaces == ("shop.orders.OrderRepository",)
    assert by_type["shop.orders"].domain == "shop"
    assert by_type["shop.orders"].name == "orders"
    expected = {
        GraphLink("shop.orders.OrderRepository", "inherits", "shop.base.Repository"),
        GraphLink("shop.orders.CachedOrders", "inherits", "shop.orders.OrderRepository"),
        GraphLink("shop.orders", "imports", "shop.base"),
        GraphLink("shop.orders", "imports", "shop.pricing"),
        GraphLink("shop.orders", "imports", "shop.tax"),
        GraphLink("shop.orders.OrderRepository", "calls", "shop.pricing"),  # pricing.price(...)
        GraphLink("shop.orders.OrderRepository", "calls", "shop.tax"),  # tax.vat(...) through an alias
        GraphLink("shop.orders", "calls", "shop.orders.OrderRepository"),  # make() constructs it
        GraphLink("shop.tax", "imports", "shop.pricing"),  # an absolute import under a prefix the tree lacks
        GraphLink("shop.tax", "calls", "shop.pricing"),
    }
    assert expected <= set(links)
    assert all(link.source_type != link.target_type for link in links)


def _rows() -> GraphRows:
    return GraphRows(
        nodes=[
            NodeRow("main", "m.Base", "class", (), False, False),
            NodeRow("main", "m.Impl", "class", ("m.Base",), False, False),
            NodeRow("main", "m.Deep", "class", ("m.Impl",), False, False),
            NodeRow("main", "m.Gone", "class", ("m.Base",), False, False),
            NodeRow("feature", "m.Gone", None, (), True, False),  # the branch removes Gone
            NodeRow("feature", "m.New", "class", ("m.Base",), False, False),  # and adds New
            NodeRow("feature", "m.Deep", None, (), True, True),  # a revert: main's Deep shows through
        ],
        links=[
            LinkRow("main", "m.Impl", "calls", "m.Util", False, False),
            LinkRow("main", "m.Deep", "calls", "m.Util", False, False),
            LinkRow("main", "m.Impl", "imports", "m.Old", False, False),
            LinkRow("feature", "m.Impl", "imports", "m.Old", True, False),
            LinkRow("other", "m.Impl", "calls", "m.Secret", False, False),
            LinkRow("main", "m.Gone", "inherits", "m.Base", False, False),
        ],
        version="1-a",
    )


def test_a_module_a_branch_holds_hides_mains_rows_of_it() -> None:
    """A module the branch has a row of (a file it changed, sent whole; or deleted) hides main's nodes of the types
    it defines and main's links from them; a module it has no row of follows main."""
    main_rows = [
        NodeRow("main", "pkg.mod", "module", (), False, False),
        NodeRow("main", "pkg.mod.Kept", "class", ("pkg.Other",), False, False),  # main, later: another base
        NodeRow("main", "pkg.mod.Later", "class", ("pkg.Base",), False, False),  # main, later: a new class
        NodeRow("main", "pkg.mod.Kept.Inner", "class", ("pkg.Base",), False, False),
        NodeRow("main", "pkg.gone", "module", (), False, False),
        NodeRow("main", "pkg.gone.More", "class", ("pkg.Base",), False, False),
        NodeRow("main", "pkg.free", "module", (), False, False),
        NodeRow("main", "pkg.free.Loose", "class", ("pkg.Base",), False, False),
        NodeRow("main", "pkg", "module", (), False, False),
    ]
    rows = GraphRows(
        nodes=[
            *main_rows,
            NodeRow("feat", "pkg.mod", "module", (), False, False),  # the branch holds mod.py whole
            NodeRow("feat", "pkg.mod.Kept", "class", ("pkg.Base",), False, False),
            NodeRow("feat", "pkg.gone", None, (), True, False),  # and deleted gone.py
        ],
        links=[
            LinkRow("main", "pkg.mod", "imports", "pkg.free", False, False),
            LinkRow("main", "pkg.mod.Later", "calls", "pkg.free.Loose", False, False),
            LinkRow("main", "pkg.free", "imports", "pkg.mod", False, False),
            LinkRow("feat", "pkg.mod", "imports", "pkg.gone", False, False),
        ],
        whole_modules=frozenset({"pkg.mod", "pkg.gone"}),
    )
    feat = overlay(rows, "feat")
    assert set(feat.kinds) == {"pkg", "pkg.mod", "pkg.mod.Kept", "pkg.free", "pkg.free.Loose"}
    assert feat.derived("pkg.Base") == ["pkg.free.Loose", "pkg.mod.Kept"]
    assert feat.links == {("pkg.free", "imports", "pkg.mod"), ("pkg.mod", "imports", "pkg.gone")}
    assert set(overlay(rows, "main").kinds) == {r.object_type for r in main_rows}
    # A branch with no row of a module (ingested by an earlier release), or whose documents do not say it holds
    # the file whole (another producer's module node alone: a review's), overrides by key only, as before.
    older = overlay(GraphRows(nodes=[*main_rows, rows.nodes[-2]], links=rows.links[:3]), "feat")
    alone = overlay(dataclasses.replace(rows, whole_modules=frozenset()), "feat")
    assert (
        alone.derived("pkg.Base")
        == older.derived("pkg.Base")
        == [
            "pkg.free.Loose",
            "pkg.gone.More",
            "pkg.mod.Kept",
            "pkg.mod.Kept.Inner",
            "pkg.mod.Later",
        ]
    )
    assert defining_module("pkg.mod.Kept.Inner", {"pkg", "pkg.mod"}) == "pkg.mod"
    assert defining_module("pkg.free", {"pkg", "pkg.mod"}) == "pkg"
    assert defining_module("elsewhere.X", {"pkg"}) is None


def test_overlay_and_subtypes() -> None:
    main = overlay(_rows(), "main")
    feature = overlay(_rows(), "feature")
    assert main.with_subtypes("m.Base") == {"m.Base", "m.Impl", "m.Deep", "m.Gone"}
    assert feature.with_subtypes("m.Base") == {"m.Base", "m.Impl", "m.Deep", "m.New"}
    assert ("m.Impl", "imports", "m.Old") in main.links
    assert ("m.Impl", "imports", "m.Old") not in feature.links
    assert all("m.Secret" not in link for link in feature.links)  # another branch never leaks in


def test_a_relation_question_finds_types_by_name_then_subtypes_by_distance_and_importers() -> None:
    graph = OntologyGraph(
        kinds={t: "class" for t in ("a.Base", "a.base", "b.Base", "a.Left", "a.Right", "a.Leaf", "a.Both")},
        interfaces={
            "a.Left": ("a.Base",),
            "a.Right": ("a.Base",),
            "a.Leaf": ("a.Left",),
            "a.Both": ("a.Left", "a.Right"),  # reached twice: listed once, at its nearest
        },
        links={("a.Left", "imports", "a.Base"), ("a.Right", "calls", "a.Base"), ("a.Base", "imports", "b.Base")},
    )
    assert graph.named("Base") == ["a.Base", "b.Base"]  # as written; a.base only matches ignoring case
    assert graph.named("a.Base") == ["a.Base"]
    assert graph.named("BASE") == ["a.Base", "a.base", "b.Base"]
    assert graph.named("Missing") == []
    # A whole qualified name is that type alone: not also a private module's published as it (an agent tester's
    # importers of faststream.types were faststream._internal.types's 78).
    published = OntologyGraph(kinds={t: "module" for t in ("fs.types", "fs._internal.types", "x.fs.types")})
    assert published.named("fs.types") == ["fs.types"]
    assert published.named("types") == ["fs._internal.types", "fs.types", "x.fs.types"]
    assert graph.subtypes("a.Base") == [["a.Left", "a.Right"], ["a.Both", "a.Leaf"]]
    assert graph.subtypes("a.Leaf") == []
    assert graph.supertypes("a.Both") == [["a.Left", "a.Right"], ["a.Base"]]
    assert graph.resolution_order("a.Both") == ["a.Left", "a.Right", "a.Base"]  # Python's order: a diamond's base last
    # A Go type's embedded struct (and what it embeds) before the interface it satisfies, as its bases are listed:
    # an agent tester's Comment.Pos was the interface's, nearer by distance; a Java superclass chain before an
    # interface; a cycle ends.
    go = OntologyGraph(interfaces={"e.Comment": ("a.Ident", "a.Node"), "a.Ident": ("a.base",), "a.base": ("a.Node",)})
    assert go.supertypes("e.Comment") == [["a.Ident", "a.Node"], ["a.base"]]
    assert go.resolution_order("e.Comment") == ["a.Ident", "a.base", "a.Node"]
    cycle = OntologyGraph(interfaces={"c.A": ("c.B",), "c.B": ("c.A",)})
    assert cycle.resolution_order("c.A") == ["c.B"]
    # A chain of 500 (a review's RecursionError): past MAX_RESOLVED_TYPES bases, nearest first.
    chain = OntologyGraph(interfaces={f"k.C{i}": (f"k.C{i + 1}",) for i in range(500)})
    assert chain.resolution_order("k.C0") == [f"k.C{i}" for i in range(1, 501)]
    assert graph.linked("a.Base", "imports", "incoming") == ["a.Left"]  # a calls link is no import
    assert graph.linked("a.Base", "imports", "outgoing") == ["b.Base"]


def test_a_file_and_the_type_it_is_named_after_are_one_symbol_to_ask_about() -> None:
    """Java's ``Ledger.java`` is the module ``src.com.acme.Ledger`` holding the class ``src.com.acme.Ledger.Ledger``:
    its importers are the file's, its subclasses the class's, and the name is no two symbols."""
    graph = OntologyGraph(
        kinds={"s.Ledger": "module", "s.Ledger.Ledger": "class", "s.Ledger.Ledger.Entry": "class", "s.util": "module",
               "s.util.Util": "class", "s.Audit": "module"},
        interfaces={"s.Ledger.Ledger.Entry": ("s.Ledger.Ledger",)},
        links={("s.Audit", "imports", "s.Ledger")},
    )  # fmt: skip
    named = graph.named("Ledger")
    assert named == ["s.Ledger", "s.Ledger.Ledger"]
    assert graph.as_files_or_types(named, files=True) == ["s.Ledger"]
    assert graph.as_files_or_types(named, files=False) == ["s.Ledger.Ledger"]
    assert graph.as_files_or_types(["s.Ledger.Ledger"], files=True) == ["s.Ledger"]
    # A type nested in it is imported by the file too (`import com.acme.Ledger.Entry`, a retest's).
    assert graph.as_files_or_types(["s.Ledger.Ledger.Entry"], files=True) == ["s.Ledger"]
    # A nested type, a module and a class not named alike, a package's module of its name (app/app.py: a
    # review's), stay as they are.
    packaged = OntologyGraph(kinds={"app": "module", "app.app": "module"}, links={("web", "imports", "app.app")})
    assert packaged.as_files_or_types(["app.app"], files=True) == ["app.app"]
    assert packaged.as_files_or_types(["app"], files=True) == ["app"]
    assert graph.as_files_or_types(["s.Ledger.Ledger.Entry"], files=False) == ["s.Ledger.Ledger.Entry"]
    for other in ("s.util", "s.util.Util"):
        assert graph.as_files_or_types([other], files=True) == graph.as_files_or_types([other], files=False) == [other]


def test_a_type_named_only_by_other_rows_is_known_to_every_relation() -> None:
    """A tester removed the node r.util while r.Sub still derived from it and r.Svc imported it: expansion, the
    importers and the objectType filter still followed those rows, but "what subclasses util" found nothing and
    called the name unknown. A type a link or a base names answers every relation alike, a node's or not."""
    graph = OntologyGraph(
        kinds={"r.Svc": "module", "r.Sub": "class"},
        interfaces={"r.Sub": ("r.util", "Exception")},
        links={("r.Svc", "imports", "r.util")},
    )
    assert graph.named("util") == ["r.util"]
    assert graph.subtypes("r.util") == [["r.Sub"]]
    assert graph.linked("r.util", "imports", "incoming") == ["r.Svc"]
    assert graph.named("Exception") == ["Exception"]  # a base outside the tree: its subclasses in it
    assert graph.subtypes("Exception") == [["r.Sub"]]
    # What a class inherits from, as subtypes reads it the other way (a tester's bases and subclasses disagreed
    # once a base's node was removed): an answer shows those a document defines.
    assert graph.supertypes("r.Sub") == [["Exception", "r.util"]]


def test_a_name_the_graphs_own_type_bears_is_that_type_not_an_outside_base_of_the_same_name() -> None:
    """An agent tester's "what subclasses Response" over starlette listed a class deriving from httpx.Response as
    deriving from the symbol asked: a type of the graph's own goes before an outside base of its name."""
    graph = OntologyGraph(
        kinds={"s.responses.Response": "class", "s.responses.JSONResponse": "class", "s.testclient.Denial": "class"},
        interfaces={"s.responses.JSONResponse": ("s.responses.Response",), "s.testclient.Denial": ("httpx.Response",)},
    )
    assert graph.named("Response") == ["s.responses.Response"]
    assert graph.named("httpx.Response") == ["httpx.Response"]  # asked by its own name, the outside base still is
    assert graph.subtypes(graph.named("Response")[0]) == [["s.responses.JSONResponse"]]
    # One the name names better than any own type stays: the stdlib module beside an own pkg.logging (a review's).
    modules = OntologyGraph(
        kinds={"pkg.logging": "module", "pkg.cli": "module"},
        links={("pkg.cli", "imports", "pkg.logging"), ("pkg.logging", "imports", "logging")},
    )
    assert modules.named("logging") == ["logging", "pkg.logging"]


def test_expansion_deduplicates_linked_types_and_skips_the_hits_own_types() -> None:
    graph = overlay(_rows(), "main")
    expansions = expand(graph, [("doc-impl", "m.Impl"), ("doc-deep", "m.Deep"), ("doc-base", "m.Base")])
    linked = [(e.linked_type, e.link_name, e.direction, e.linked_from_document_id) for e in expansions]
    # Util is reached from Impl and Deep: it appears once, from the better-ranked hit. Base, Impl and Deep are
    # hits themselves, so their links to each other are not context.
    assert ("m.Util", "calls", "outgoing", "doc-impl") in linked
    assert [t for t, *_ in linked].count("m.Util") == 1
    assert ("m.Old", "imports", "outgoing", "doc-impl") in linked
    assert ("m.Gone", "inherits", "incoming", "doc-base") in linked  # a link into a hit's type, followed back
    assert not {"m.Impl", "m.Deep", "m.Base"} & {t for t, *_ in linked}
    # Interfaces are not links: New implements Base on the feature branch only through its interfaces.
    feature = expand(overlay(_rows(), "feature"), [("doc-base", "m.Base")])
    assert "m.New" not in {e.linked_type for e in feature}


def test_expansion_is_bounded() -> None:
    graph = OntologyGraph(links={("hub.Core", "imports", f"leaf.M{i:03}") for i in range(500)})
    everything = expand(graph, [("doc", "hub.Core")])
    assert len(everything) == 500
    bounded = expand(graph, [("doc", "hub.Core")], limit=25)
    assert bounded == everything[:25]


async def test_graph_cache_loads_once_per_version() -> None:
    loads: list[tuple[str, str]] = []

    async def load(workspace: str, branch: str) -> GraphRows:
        loads.append((workspace, branch))
        return _rows()

    cache = GraphCache(load, max_graphs=2)
    first = await cache.get("w", "main", "1-a")
    assert first.version == "1-a"
    assert await cache.get("w", "main", "1-a") is first
    newer = await cache.get("w", "main", "0-z")  # asked for a version the data has already left behind
    assert newer.version == "1-a"  # the graph says which version it is; the caller compares
    assert loads == [("w", "main"), ("w", "main")]
    assert await cache.get("w", "main", "1-a") is newer  # kept under the version it was read at
    await cache.get("w", "feature", "1-a")
    await cache.get("w", "other", "1-a")  # the bound of two graphs evicts main's
    await cache.get("w", "main", "1-a")
    assert len(loads) == 5
    current = {"main": "1-a", "other": "2-b"}
    assert cache.drop_stale("w", lambda branch: current.get(branch, "none")) == 1  # other's 1-a is stale
    await cache.get("w", "main", "1-a")
    assert len(loads) == 5


def test_an_import_of_a_module_of_the_trees_package_that_is_gone_is_still_a_link() -> None:
    """An agent tester's: a branch moved a module, and every importer it left unchanged lost its link (and so was
    no longer among the module's importers). Another project's module stays no link."""
    _, links = python_graph(
        {
            "pkg/__init__.py": "",
            "pkg/here.py": "X = 1\n",
            "pkg/use.py": "from pkg.gone import f\nimport pkg.also_gone\nfrom . import here\nimport numpy.gone\n",
        }
    )
    assert {link for link in links if link.source_type == "pkg.use"} == {
        GraphLink("pkg.use", "imports", "pkg.gone"),
        GraphLink("pkg.use", "imports", "pkg.also_gone"),
        GraphLink("pkg.use", "imports", "pkg"),
        GraphLink("pkg.use", "imports", "pkg.here"),
    }
    # A namespace package is shared with other projects: `google.protobuf` is not this tree's (a review's).
    _, shared = python_graph(
        {
            "google/cloud/foo/__init__.py": "",
            "google/cloud/foo/client.py": "import google.protobuf\nfrom google.auth import credentials\n",
        }
    )
    assert [link for link in shared if link.source_type == "google.cloud.foo.client"] == []


def test_a_package_below_the_trees_top_is_imported_by_its_own_name() -> None:
    """A tester's monorepo and `src` layout: `src/shoplib/cart.py` imports `shoplib.pricing`, which no module was
    named (they were `src.shoplib.…`), so "what calls compute_total" found no caller. A name two packages of the
    tree would share (`common` of two services) is nobody's."""
    from ontofabric.services.ingest.graph import python_calls

    sources = {
        "src/shoplib/__init__.py": "from shoplib.core import *\n",
        "src/shoplib/core.py": "__all__ = ['Cart']\n\n\nclass Cart: ...\n",
        "src/shoplib/pricing.py": "def compute_total(cart): ...\n",
        "src/shoplib/cart.py": (
            "from shoplib.pricing import compute_total\nimport shoplib\n\n\n"
            "def checkout(cart):\n    return compute_total(shoplib.Cart())\n"
        ),
        "services/a/common/__init__.py": "",
        "services/a/common/util.py": "def f(): ...\n",
        "services/b/common/__init__.py": "",
        "services/b/common/util.py": "def f(): ...\n",
        "services/b/main.py": "from common.util import f\n\n\ndef run():\n    f()\n",
    }
    _, links = python_graph(sources)
    assert {link for link in links if link.source_type.startswith("src.shoplib.cart")} == {
        GraphLink("src.shoplib.cart", "imports", "src.shoplib.pricing"),
        GraphLink("src.shoplib.cart", "imports", "src.shoplib"),
        GraphLink("src.shoplib.cart", "calls", "src.shoplib.pricing"),
    }
    assert not [link for link in links if link.source_type == "services.b.main"]
    # Found by the name it is imported by too: a tester's `shoplib.pricing.compute_total` named nothing.
    from ontofabric.services.ingest.ingester import chunk_sources

    chunks = {c.symbol_fqn: c for c in chunk_sources(Path("."), sources, 1 << 20)}
    assert chunks["src.shoplib.pricing.compute_total"].aliases == ("shoplib.pricing.compute_total",)
    assert chunks["src.shoplib.pricing"].aliases == ("shoplib.pricing",)
    assert chunks["src.shoplib.core.Cart"].aliases == ("shoplib.core.Cart", "src.shoplib.Cart", "shoplib.Cart")
    assert chunks["services.b.main.run"].aliases == ()  # in no package: named as before
    assert chunks["services.a.common.util.f"].aliases == ()  # a name two packages would take is nobody's
    # A review's: a package two directories hold, even where only one has the module asked (two services' `app`),
    # and a package named as the standard library's modules (a test fixture's `json`), are no import names.
    shadowing = {
        "svc_a/src/app/__init__.py": "", "svc_a/src/app/models.py": "class User: ...\n",
        "svc_b/src/app/__init__.py": "",
        "svc_b/src/app/views.py": "from app.models import User\n\n\ndef v():\n    User()\n",
        "tests/fixtures/json/__init__.py": "def loads(x): ...\n",
        "app/main.py": "import json\n\n\ndef m(x):\n    return json.loads(x)\n",
    }  # fmt: skip
    _, shadowed = python_graph(shadowing)
    assert [link for link in shadowed if link.source_type in ("svc_b.src.app.views", "app.main")] == []
    assert python_calls(shadowing) == {}
    calls = _by_name(python_calls(sources))
    assert calls[("src/shoplib/cart.py", "src.shoplib.cart.checkout")] == (
        "src.shoplib.core.Cart",  # through the package's `*`
        "src.shoplib.pricing.compute_total",
    )
    assert ("services/b/main.py", "services.b.main.run") not in calls


def test_a_base_written_through_a_package_that_re_exports_it_is_the_trees_class() -> None:
    """An agent tester's anyio: `class TaskGroup(abc.TaskGroup)` after `from .. import abc`, whose __init__
    re-exports the class from `abc._tasks`, was taken for an outside base named `abc.TaskGroup`, so "what
    subclasses TaskGroup" found none of the 24 backend classes written so."""
    nodes, links = python_graph(
        {
            "lib/__init__.py": "",
            "lib/abc/__init__.py": "from ._tasks import TaskGroup as TaskGroup\nfrom ._more import *\n",
            "lib/abc/_tasks.py": "class TaskGroup:\n    pass\n",
            "lib/api.py": "from .abc import TaskGroup\n",  # re-exported twice over
            "lib/_backends/__init__.py": "",
            "lib/_backends/_asyncio.py": (
                "from .. import abc\nfrom ..api import TaskGroup as Base\n\n"
                "class TaskGroup(abc.TaskGroup):\n    pass\n\nclass Other(Base):\n    pass\n"
            ),
        }
    )
    by_type = {n.object_type: n for n in nodes}
    assert by_type["lib._backends._asyncio.TaskGroup"].interfaces == ("lib.abc._tasks.TaskGroup",)
    assert by_type["lib._backends._asyncio.Other"].interfaces == ("lib.abc._tasks.TaskGroup",)
    assert GraphLink("lib._backends._asyncio.TaskGroup", "inherits", "lib.abc._tasks.TaskGroup") in links


def test_bases_without_a_name_are_no_interfaces_and_every_name_is_a_valid_object_type() -> None:
    from ontofabric.contracts import NodeUpserted, OntologyNode

    fields = " ".join(f"field{i}" for i in range(200))
    source = textwrap.dedent(f"""
        import typing
        from collections import namedtuple

        class Row(namedtuple("Row", "{fields}")):
            pass

        class Box(typing.Generic[T], external.pkg.Base):
            pass

        class {"Deep" * 140}:
            pass
    """)
    nodes, _ = python_graph({"lib/rows.py": source})
    by_name = {n.name: n for n in nodes}
    assert by_name["Row"].interfaces == ()  # computed by a call: no name to give it
    assert by_name["Box"].interfaces == ("typing.Generic", "external.pkg.Base")
    assert "Deep" * 140 not in by_name  # a name the contract cannot carry leaves the graph, not the ingest
    for node in nodes:  # each one survives the contract, so an ingest never stops on one class
        NodeUpserted(
            node=OntologyNode(domain=node.domain, name=node.name, kind=node.kind, interfaces=list(node.interfaces))
        )


CALLING = {
    "pkg/__init__.py": "from .core import run\n\n\ndef helper():\n    return run()\n",
    "pkg/core.py": textwrap.dedent(
        """
        import pkg.util as util
        from . import util as u2

        START = util.clock()

        def run():
            return run() or util.clock() + u2.clock()

        class Base:
            def step(self):
                return util.clock()

            def go(self):
                return self.step()

        class Child(Base):
            label = util.name()

            def go(self):
                return super().go() + self.step() + Base.go(self) + self.missing() + other.step()

            @classmethod
            def make(cls):
                return cls.go(None)
        """
    ),
    "pkg/util.py": textwrap.dedent(
        """
        import typing

        @typing.overload
        def clock(x: int) -> int: ...
        def clock(x=None):
            return name()

        def name():
            return "n"
        """
    ),
    "pkg/app.py": "from pkg import run\n\n\ndef main():\n    return run()\n",
    "pkg/broken.py": "def (:",
}


def _by_name(calls: Mapping[tuple[str, str, int], tuple[str, ...]]) -> dict[tuple[str, str], tuple[str, ...]]:
    """The calls by file and qualified name, where each name is defined once with calls."""
    named = {(path, fqn): found for (path, fqn, _), found in calls.items()}
    assert len(named) == len(calls)
    return named


def test_what_an_overload_stubs_signature_calls_is_its_implementations() -> None:
    """tenacity's `retry` stubs call retry_if_exception_type() in their defaults; left out as chunks, their calls
    went with them until they were given to the implementation."""
    from ontofabric.services.ingest.graph import python_calls

    source = textwrap.dedent(
        """
        import typing as t

        def default():
            return 1

        @t.overload
        def retry(x: int = default()) -> int: ...

        def retry(x=None):
            return x
        """
    )
    assert python_calls({"r.py": source}) == {("r.py", "r.retry", 10): ("r.default",)}


def test_a_propertys_getter_and_setter_each_call_what_they_call() -> None:
    """A tester's: the getter of rich's Text.plain was said to call strip_control_codes, which only its setter
    calls: both were keyed by their shared name."""
    from ontofabric.services.ingest.graph import python_calls

    source = textwrap.dedent(
        """
        def clean(text):
            return text

        class Text:
            @property
            def plain(self):
                return self._text

            @plain.setter
            def plain(self, value):
                self._text = clean(value)
        """
    )
    assert python_calls({"t.py": source}) == {("t.py", "t.Text.plain", 11): ("t.clean",)}
    chunks = {c.line: c for c in chunk_sources(Path("."), {"t.py": source}, 10_000) if c.symbol_fqn == "t.Text.plain"}
    assert (chunks[7].calls, chunks[11].calls) == ((), ("t.clean",))


def test_python_calls_resolve_what_the_syntax_tells_and_leave_out_the_rest() -> None:
    from ontofabric.services.ingest.graph import python_calls

    calls = _by_name(python_calls(CALLING))
    assert calls == {
        ("pkg/__init__.py", "pkg.helper"): ("pkg.core.run",),
        ("pkg/app.py", "pkg.app.main"): ("pkg.core.run",),  # through the package, which imports it in turn
        # The module's own statements; a module imported as an alias, under either spelling.
        ("pkg/core.py", "pkg.core"): ("pkg.util.clock",),
        ("pkg/core.py", "pkg.core.run"): ("pkg.util.clock",),  # calling itself is no caller
        ("pkg/core.py", "pkg.core.Base.step"): ("pkg.util.clock",),
        ("pkg/core.py", "pkg.core.Base.go"): ("pkg.core.Base.step",),
        ("pkg/core.py", "pkg.core.Child"): ("pkg.util.name",),  # the class's body outside its methods
        # super() and an inherited self.step reach the base's methods; a method the tree does not define, or a
        # call through another object, is left out.
        ("pkg/core.py", "pkg.core.Child.go"): ("pkg.core.Base.go", "pkg.core.Base.step"),
        ("pkg/core.py", "pkg.core.Child.make"): ("pkg.core.Child.go",),
        # An overload stub and the definition share one name: the stub is no chunk, and what it calls is the
        # definition's.
        ("pkg/util.py", "pkg.util.clock"): ("pkg.util.name",),
    }


def test_a_generic_class_made_through_its_parameters_is_called() -> None:
    """An agent tester's anyio `_MemoryObjectItemReceiver[T_co]()` was no call of the class; a mapping's item called
    is no call of the mapping, and a local of the class's name hides it."""
    from ontofabric.services.ingest.graph import python_calls

    sources = {
        "pkg/box.py": "HANDLERS = {}\n\n\nclass Box:\n    def open(self):\n        return 1\n",
        "pkg/use.py": textwrap.dedent(
            """
            from . import box
            from .box import HANDLERS, Box

            def make():
                b = Box[int]()
                return b.open(), box.Box[str]()

            def handle(key):
                return HANDLERS[key]()

            def shadowed(Box):
                return Box[int](), Box[int][str]()
            """
        ),
    }
    calls = _by_name(python_calls(sources))
    assert calls == {("pkg/use.py", "pkg.use.make"): ("pkg.box.Box", "pkg.box.Box.open")}


def test_a_call_of_a_name_a_module_of_the_tree_no_longer_binds_is_kept_under_that_modules_name() -> None:
    """What a branch deleted, renamed or moved, still called: "what calls it" reads these (note 90's). A name a
    module may bind in any way is not one it no longer binds (a review's)."""
    from ontofabric.services.ingest.graph import python_calls

    sources = {
        "pkg/__init__.py": "",
        "pkg/mod.py": (
            "from os.path import join\nfrom .more import *\nALIAS = join\nVALUE = 1\n__all__ = ['listed']\n"
            "for looped in range(2):\n    pass\nwith open('x') as opened:\n    pass\n\n\n"
            "def kept():\n    global late\n    late = 1\n"
        ),
        "pkg/more.py": "def starred():\n    pass\n",
        "pkg/lazy.py": "def __getattr__(name):\n    return name\n",
        "pkg/lazier.py": "from ._lazy import module_getattr as __getattr__\n",
        "pkg/fast.py": "from ._speedups import *\n",
        "pkg/dyn.py": "globals().update({'made': 1})\n",
        "pkg/sub/__init__.py": "",
        "pkg/use.py": (
            "from pkg.mod import gone, join, ALIAS, VALUE, starred, kept, listed, looped, opened, late\n"
            "from pkg import mod, sub, lazier, fast, dyn\n"
            "from pkg.lazy import anything\n"
            "from pkg.moved import f\n"
            "from os.path import nothing\n"
            "from numpy.mod import gone as other\n\n\n"
            "def caller():\n"
            "    gone(); mod.also_gone(); join(); ALIAS(); VALUE(); starred(); kept(); sub(); anything(); nothing()\n"
            "    other(); listed(); looped(); opened(); late(); lazier.x(); fast.y(); dyn.made(); f()\n\n\n"
            "def shadowing(mod):\n    mod.update()\n"
        ),
    }
    calls = _by_name(python_calls(sources))
    assert calls[("pkg/use.py", "pkg.use.caller")] == (
        "pkg.mod.ALIAS",  # bound to an outside name: its module's value, as before
        "pkg.mod.VALUE",
        "pkg.mod.also_gone",
        "pkg.mod.gone",
        "pkg.mod.kept",
        "pkg.more.starred",
        "pkg.moved.f",  # a module of the tree's package that is gone
    )
    assert ("pkg/use.py", "pkg.use.shadowing") not in calls
    # A module gone whose last part names another module of the tree (a top-level util.py): still gone (a review's).
    beside = {"pkg/__init__.py": "", "util.py": "", "pkg/use.py": "from pkg.util import f\n\n\ndef g():\n    f()\n"}
    assert _by_name(python_calls(beside)) == {("pkg/use.py", "pkg.use.g"): ("pkg.util.f",)}
    # Imports naming the tree through a package prefix it does not hold, as the resolver reads them.
    prefixed = {
        "services/__init__.py": "",
        "services/u.py": "def kept():\n    pass\n",
        "services/w.py": "from ontofabric.services.u import gone\n\n\ndef g():\n    gone()\n",
    }
    assert _by_name(python_calls(prefixed)) == {("services/w.py", "services.w.g"): ("services.u.gone",)}
    # A __getattr__ that serves the names it tests for, and raises for the rest (click's parser, for six
    # deprecated names): any other name it does not bind is unbound (an agent tester's half-done rename).
    shim = (
        "def __getattr__(name):\n    import warnings\n\n    if name in {'old', 'Older'}:\n"
        "        warnings.warn(f'{name} is deprecated')\n        return globals()[f'_{name}']\n"
        "    elif name == 'oldest':\n        return 3\n\n    raise AttributeError(name)\n"
    )
    served = {
        "pkg/__init__.py": "",
        "pkg/shim.py": shim,
        "pkg/open.py": shim.replace("    raise AttributeError(name)\n", "    return None\n"),  # serves any name
        "pkg/use.py": (
            "from pkg.shim import old, oldest, renamed\nfrom pkg.open import anything\n\n\n"
            "def caller():\n    old(); oldest(); renamed(); anything()\n"
        ),
    }
    assert _by_name(python_calls(served)) == {("pkg/use.py", "pkg.use.caller"): ("pkg.shim.renamed",)}


def test_a_call_through_a_parameter_annotated_with_a_class_of_the_tree_calls_its_method() -> None:
    """An agent tester's callers of click's Context.invoke missed Command.invoke and Group.invoke, which call it
    through their `ctx: Context`."""
    from ontofabric.services.ingest.graph import python_calls

    sources = {
        "pkg/__init__.py": "",
        "pkg/core.py": """
import typing as t

class Context:
    def invoke(self, f):
        return f()

class Sub(Context):
    def forward(self):
        return 1

class Command:
    def invoke(self, ctx: Context):
        return ctx.invoke(self)

    def main(self, ctx: "Context | None" = None, sub: t.Optional["Sub"] = None, n: int = 0):
        ctx.invoke(n)
        sub.invoke(n)  # inherited
        sub.forward()

    def rebinds(self, ctx: Context):
        ctx = make()
        ctx.invoke(1)

    def shadows(self, ctx: Context):
        def inner(ctx):
            return ctx.invoke(3)

        return inner

    def untyped(self, ctx, other: list[Context]):
        ctx.invoke(1)
        other.invoke(2)

    def caught(self, ctx: Context):
        try:
            pass
        except Exception as ctx:
            ctx.invoke(1)

    def imports(self, ctx: Context):
        import os as ctx
        ctx.invoke(1)

    def starred(self, ctx: Context):
        def g(*ctx):
            return ctx.invoke(1)

        return g

    def matched(self, ctx: Context, x: int):
        match x:
            case [ctx]:
                ctx.invoke(1)

    def named(self, ctx: Context):
        def ctx():
            return 1

        ctx.invoke(1)

class Outer:
    class Context:
        def invoke(self):
            return 2

    def run(self, ctx: Context):
        return ctx.invoke()

class Aliased:
    Context = Sub  # what the annotations of its methods name (a third review's)

    def run(self, ctx: Context):
        return ctx.invoke(1)
""",
        # Written to be costly: an ingest of any tree reads them, and one stopped it whole (a review's).
        "pkg/deep.py": "from .core import Context\n\n\ndef f(ctx: Context" + " | None" * 1500 + "):\n"
        "    return ctx.invoke()\n\n\ndef g(ctx: '\\ud800'):\n    return ctx.invoke()\n",
    }
    calls = _by_name(python_calls(sources))
    assert calls[("pkg/core.py", "pkg.core.Command.invoke")] == ("pkg.core.Context.invoke",)
    assert calls[("pkg/core.py", "pkg.core.Command.main")] == ("pkg.core.Context.invoke", "pkg.core.Sub.forward")
    # Bound again, by the function or by a function inside it: its type is no longer what the annotation says.
    for name in ("rebinds", "shadows", "untyped", "caught", "imports", "starred", "matched", "named"):
        assert ("pkg/core.py", f"pkg.core.Command.{name}") not in calls, name
    # The class's own nested Context, which the tree does not name as a class of its own: no caller of the module's.
    assert ("pkg/core.py", "pkg.core.Outer.run") not in calls
    assert ("pkg/core.py", "pkg.core.Aliased.run") not in calls
    assert ("pkg/deep.py", "pkg.deep.f") not in calls  # too deep to name one type: left out, not the ingest


def test_a_call_through_a_local_bound_once_to_what_a_class_or_an_annotated_function_makes_calls_its_method() -> None:
    """`ctx = get_current_context()` then `ctx.invoke(...)`, as click's decorators call Context.invoke (inside
    functions of their own: those nested locals are not read yet); `client = Client()` then `client.get()`."""
    from ontofabric.services.ingest.graph import python_calls

    sources = {
        "pkg/__init__.py": "",
        "pkg/core.py": """
class Context:
    def invoke(self, f):
        return f()

    def child(self) -> "Context":
        return Context()

def get_current_context() -> Context:
    return Context()

async def fetch_context() -> Context:
    return Context()

class Client:
    def get(self):
        return 1

def use():
    ctx = get_current_context()
    return ctx.invoke(1)

def make():
    client = Client()
    client.get()

def chained(ctx: Context):
    inner = ctx.child()
    inner.invoke(2)

async def awaited():
    ctx = await fetch_context()
    ctx.invoke(3)

def annotated():
    ctx: Context = something()
    ctx.invoke(5)

async def not_awaited():
    ctx = fetch_context()
    ctx.invoke(3)

def twice():
    ctx = get_current_context()
    ctx = 5
    ctx.invoke(4)

def caught():
    ctx = get_current_context()
    try:
        pass
    except Exception as ctx:
        ctx.invoke(6)
""",
    }
    calls = _by_name(python_calls(sources))
    assert calls[("pkg/core.py", "pkg.core.use")] == ("pkg.core.Context.invoke", "pkg.core.get_current_context")
    assert calls[("pkg/core.py", "pkg.core.make")] == ("pkg.core.Client", "pkg.core.Client.get")
    assert calls[("pkg/core.py", "pkg.core.chained")] == ("pkg.core.Context.child", "pkg.core.Context.invoke")
    assert calls[("pkg/core.py", "pkg.core.awaited")] == ("pkg.core.Context.invoke", "pkg.core.fetch_context")
    assert calls[("pkg/core.py", "pkg.core.annotated")] == ("pkg.core.Context.invoke",)
    # A coroutine not awaited is no Context; a name bound twice, or also otherwise, may be anything.
    assert calls[("pkg/core.py", "pkg.core.not_awaited")] == ("pkg.core.fetch_context",)
    assert calls[("pkg/core.py", "pkg.core.twice")] == ("pkg.core.get_current_context",)
    assert calls[("pkg/core.py", "pkg.core.caught")] == ("pkg.core.get_current_context",)


def test_a_nested_function_reads_its_own_locals_and_those_of_the_functions_around_it() -> None:
    """A tester's: attr's `attrs` defines `wrap`, whose `builder = _ClassBuilder(...)` then `builder.build_class()`
    called no method of _ClassBuilder; and a class imported inside a function made its locals unknown."""
    from ontofabric.services.ingest.graph import python_calls

    sources = {
        "pkg/__init__.py": "",
        "pkg/core.py": """
class Builder:
    def build(self):
        return 1

    def check(self):
        return 2

def outer():
    def inner():
        b = Builder()
        return b.build()
    return inner

def closure():
    b = Builder()
    def inner():
        return b.check()
    return inner

def deeper(kind):
    def middle():
        b = Builder()
        def inner():
            return b.build()
        return inner
    return middle

def rebound():
    b = Builder()
    def inner(b):
        return b.check()
    return inner
""",
        "pkg/lazy.py": """
def lazy():
    from .core import Builder

    b = Builder()
    return b.build()

def lazy_closure():
    from .core import Builder as Maker

    def inner():
        b = Maker()
        return b.check()
    return inner
""",
    }
    calls = _by_name(python_calls(sources))
    assert calls[("pkg/core.py", "pkg.core.outer")] == ("pkg.core.Builder", "pkg.core.Builder.build")
    assert calls[("pkg/core.py", "pkg.core.closure")] == ("pkg.core.Builder", "pkg.core.Builder.check")
    assert calls[("pkg/core.py", "pkg.core.deeper")] == ("pkg.core.Builder", "pkg.core.Builder.build")
    # A parameter of the nested function hides the enclosing local of its name.
    assert calls[("pkg/core.py", "pkg.core.rebound")] == ("pkg.core.Builder",)
    assert calls[("pkg/lazy.py", "pkg.lazy.lazy")] == ("pkg.core.Builder", "pkg.core.Builder.build")
    # The import of the function around it too (a review's).
    assert calls[("pkg/lazy.py", "pkg.lazy.lazy_closure")] == ("pkg.core.Builder", "pkg.core.Builder.check")


TYPED_LOCALS_HEAD = """
import contextlib
from typing import overload

class Client:
    def get(self):
        return 1

class Server:
    def get(self):
        return 2

class A:
    def run(self):
        return 1

class B:
    def run(self):
        return 2

def make() -> Client:
    return Client()
"""


@pytest.mark.parametrize(
    "body",
    [
        "def f(Client=Server):\n    c = Client()\n    c.get()\n",  # a parameter hiding the class
        "def f(make):\n    c = make()\n    c.get()\n",
        "def f(kinds):\n    for make in kinds:\n        c = make()\n        c.get()\n",
        "def f():\n    Client = Server\n    c = Client()\n    c.get()\n",
        "@overload\ndef load(x: int) -> A: ...\n@overload\ndef load(x: str) -> B: ...\ndef load(x):\n    return x\n"
        "def f():\n    v = load(1)\n    v.run()\n",  # the last stub's type is not the call's
        "if X:\n    def pick() -> Server: ...\nelse:\n    def pick() -> Client: ...\ndef f():\n    c = pick()\n"
        "    c.get()\n",
        "def f():\n    def inner():\n        c = Client()\n        return c\n    c.get()\n",  # another scope's c
        "def f():\n    class K:\n        c = Client()\n    c.get()\n",
        "def f():\n    c = Server()\n    def inner():\n        global c\n        c.get()\n",
        "def f():\n    global c\n    c.get()\n    c = Client()\n",
        "@contextlib.contextmanager\ndef session() -> Client:\n    yield Client()\ndef f():\n    s = session()\n"
        "    s.get()\n",  # a decorator that changes what the call returns
        # A review's: names the enclosing function binds hide the module's in a nested one too.
        "def f(Client):\n    def inner():\n        c = Client()\n        c.get()\n    return inner\n",
        "def f(make):\n    Client = make\n    def inner():\n        c = Client()\n        c.get()\n    return inner\n",
        "def f():\n    from other import Thing as Client\n    def inner(c: Client):\n        c.get()\n"
        "    return inner\n",
        # A name two imports bind in the module: which one a call inside a function reads, the module's table
        # cannot tell (a review's).
        "def f():\n    from .m import A as T\n    t = T()\n    t.run()\n"
        "def g():\n    from .m import B as T\n    return T\n",
    ],
)
def test_a_local_whose_one_binding_cannot_be_told_calls_no_method_through_it(body: str) -> None:
    """A review's false callers at 1.0 through locals (the fourth of this change's)."""
    from ontofabric.services.ingest.graph import python_calls

    calls = python_calls({"pkg/__init__.py": "", "pkg/m.py": TYPED_LOCALS_HEAD + body})
    through = [name for names in calls.values() for name in names if name.endswith((".get", ".run"))]
    assert through == [], through


def test_a_bare_decorator_calls_what_it_names() -> None:
    """An agent tester's "what calls fixture" over pytest found the six `@fixture(...)` with arguments and none of
    the twenty bare `@fixture`: a decorator calls what it names with what it decorates."""
    from ontofabric.services.ingest.graph import python_calls

    sources = {
        "pkg/marks.py": "def fixture(f=None, scope=None): ...\ndef final(c): ...\n",
        "pkg/use.py": textwrap.dedent(
            """
            from pkg import marks
            from pkg.marks import final, fixture

            @fixture
            def tmp(): ...

            @marks.fixture
            async def other(): ...

            @final
            class Kept:
                @fixture
                def method(self): ...

            @fixture(scope="session")
            def session(): ...

            @fixture
            def shadowing():  # its decorator runs outside it: its own local does not hide it (a review's)
                fixture = 1
                return fixture

            @fixture(scope=final())
            def defaults(x=final(), *, y=fixture()):  # nor what its decorator's arguments and defaults call
                final = fixture = 1
                return final, fixture
            """
        ),
    }
    assert _by_name(python_calls(sources)) == {
        ("pkg/use.py", "pkg.use.tmp"): ("pkg.marks.fixture",),
        ("pkg/use.py", "pkg.use.other"): ("pkg.marks.fixture",),
        ("pkg/use.py", "pkg.use.Kept"): ("pkg.marks.final",),
        ("pkg/use.py", "pkg.use.Kept.method"): ("pkg.marks.fixture",),
        ("pkg/use.py", "pkg.use.session"): ("pkg.marks.fixture",),
        ("pkg/use.py", "pkg.use.shadowing"): ("pkg.marks.fixture",),
        ("pkg/use.py", "pkg.use.defaults"): ("pkg.marks.final", "pkg.marks.fixture"),
    }


def test_a_bare_raise_of_a_class_calls_it() -> None:
    """An agent tester's "what raises FrameTooLargeError" found none: uvicorn raises it bare, which makes one as
    ``raise FrameTooLargeError()`` does. An exception held in a variable is no class of the tree."""
    from ontofabric.services.ingest.graph import python_calls

    sources = {
        "pkg/errors.py": "class TooLarge(Exception): ...\nclass Closed(Exception): ...\nclass _Abort(Exception): ...\n",
        "pkg/use.py": textwrap.dedent(
            """
            from pkg import errors
            from pkg.errors import TooLarge

            def extend(data):
                if len(data) > 10:
                    raise TooLarge
                if not data:
                    raise errors._Abort
                raise errors.Closed from None

            def reraise(exc):
                raise exc

            STOP = TooLarge("stop")

            def make():
                return TooLarge()

            def constants():  # an instance and a function raised: neither is called here
                raise STOP
                raise make

            def again():
                try:
                    extend(b"")
                except TooLarge:
                    raise
            """
        ),
    }
    calls = _by_name(python_calls(sources))
    assert calls[("pkg/use.py", "pkg.use.extend")] == ("pkg.errors.Closed", "pkg.errors.TooLarge", "pkg.errors._Abort")
    assert ("pkg/use.py", "pkg.use.reraise") not in calls
    assert ("pkg/use.py", "pkg.use.constants") not in calls
    assert calls[("pkg/use.py", "pkg.use.again")] == ("pkg.use.extend",)


def test_calls_leave_out_names_a_function_binds_and_a_nested_classs_self() -> None:
    from ontofabric.services.ingest.graph import python_calls

    source = textwrap.dedent(
        """
        import lib.util

        def run():
            return 1

        def by_parameter(run):
            return run()

        def by_assignment():
            run = make_runner()
            return run()

        def declared_global():
            global run
            return run()

        class Outer:
            def step(self):
                return 2

            def method(self):
                class Inner:
                    def go(self):
                        return self.step()  # Inner's own, which the tree does not name

                return Inner, lib.util.helper(), self.Nested()

            class Nested:
                pass
        """
    )
    calls = _by_name(python_calls({"lib/app.py": source, "lib/util.py": "def helper():\n    return 3\n"}))
    assert calls == {
        ("lib/app.py", "lib.app.declared_global"): ("lib.app.run",),
        # Through `import lib.util`; a class nested in the method's class, as a member.
        ("lib/app.py", "lib.app.Outer.method"): ("lib.app.Outer.Nested", "lib.util.helper"),
    }


def test_a_file_nested_deeper_than_the_parser_goes_is_not_read_and_stops_nothing() -> None:
    from ontofabric.services.ingest.chunking import chunk_python
    from ontofabric.services.ingest.graph import python_calls

    source = "def g():\n    return 1\n\ndef f():\n    return " + "+".join(["g()"] * 5000) + "\n"
    assert python_calls({"deep.py": source}) == {}
    assert python_graph({"deep.py": source}) == ([], [])
    assert [c.chunk_level for c in chunk_python("deep.py", source, 1 << 20)] == ["file"]


def test_a_long_dotted_name_is_read_and_stops_nothing() -> None:
    """An audit's: a base or a call written as a chain of 2,000 names (a file of 4 KB, which the parser reads)
    stopped the whole ingest with a RecursionError."""
    from ontofabric.services.ingest.graph import python_calls

    chain = ".".join(["a"] * 2000)
    base = {"pkg/__init__.py": "", "pkg/m.py": f"import a\n\n\nclass C({chain}):\n    pass\n\n\n{chain}()\n"}
    nodes, _ = python_graph(base)
    (interfaces,) = [n.interfaces for n in nodes if n.name == "C"]
    assert len(interfaces) == 1  # the chain, as far as an object type's name goes
    assert interfaces[0].startswith("a.a.a.")
    assert python_calls(base) == {}
    assert len(chunk_sources(Path("."), base, 1 << 20)) == 3  # the file, the class, and the package's file


def test_a_package_publishes_what_its_init_imports_from_the_tree_under_its_own_name() -> None:
    """A tester's: click.Option (re-exported by click/__init__.py) found nothing: the class is click.core.Option."""
    from ontofabric.services.ingest.graph import python_exports

    sources = {
        "__init__.py": "from .core import Option as Option\nfrom .core import Group as Grp\nfrom . import core\n"
        "import os\nfrom .utils import helper, missing\n",
        "core.py": "class Option: ...\nclass Group: ...\n",
        "utils.py": "def helper(): ...\n",
        "sub/__init__.py": "from ..core import Option\n",
    }
    assert python_exports(sources, "pkg") == {
        "pkg.core.Option": ("pkg.Option", "pkg.sub.Option"),
        "pkg.core.Group": ("pkg.Grp",),
        "pkg.utils.helper": ("pkg.helper",),
    }


def test_what_a_type_checker_or_a_script_alone_runs_is_no_name_the_module_has() -> None:
    """An agent tester's: rich's ``__init__`` imports ``Console`` under ``if TYPE_CHECKING:`` only, and ``rich.Console``
    was answered as a name to import (an ImportError); a demo's ``console = Console()`` under ``if __name__ ==
    "__main__":`` was a definition of ``console``. A generic base (``Base[int]``) had no inherits link."""
    from ontofabric.services.ingest.chunking import chunk_python
    from ontofabric.services.ingest.graph import python_exports

    sources = {
        "__init__.py": "import typing\nfrom typing import TYPE_CHECKING\nfrom .core import Real\n"
        "if TYPE_CHECKING:\n    from .core import Console\nelse:\n    from .core import Other\n"
        "if typing.TYPE_CHECKING:\n    from .core import *\n",
        "core.py": "class Console: ...\nclass Real: ...\nclass Other: ...\nclass Base(Generic[T]): ...\n"
        "class Sub(Base[int]): ...\nLIMIT = 3\nif __name__ == '__main__':\n    console = Console()\n    alias = Real\n",
    }
    assert python_exports(sources, "pkg") == {"pkg.core.Real": ("pkg.Real",), "pkg.core.Other": ("pkg.Other",)}
    module, *_ = chunk_python("core.py", sources["core.py"], 100_000, "pkg")
    assert module.defines == ("LIMIT",)
    _, links = python_graph(sources, "pkg")
    assert GraphLink("pkg.core.Sub", "inherits", "pkg.core.Base") in links


def test_a_module_publishes_what_it_takes_by_star_and_the_names_it_binds_to_others() -> None:
    """An agent tester's attrs: attrs.validators.instance_of (attrs/validators.py is `from attr.validators import
    *`) and attr.s (`s = attributes = attrs`) were "not indexed"."""
    from ontofabric.services.ingest.graph import python_calls, python_exports

    sources = {
        "attr/__init__.py": "from ._make import attrs\ns = attributes = attrs\nnot_a_name = attrs()\n",
        "attr/_make.py": "def attrs(): ...\n",
        "attr/validators.py": "__all__ = ['instance_of']\ndef instance_of(): ...\ndef optional(): ...\n",
        "attr/filters.py": "def include(): ...\ndef _private(): ...\n",
        "attr/_next_gen.py": "def define(): ...\nmutable = define\nloop = loop\n",
        "attrs/__init__.py": "from attr._next_gen import mutable\n",
        "attrs/validators.py": "from attr.validators import *\n",
        "attrs/filters.py": "from attr.filters import *\nfrom attrs.filters import *\n",  # itself: no loop
        "attrs/use.py": "from attr import s\n\n\ndef make():\n    return s()\n",
    }
    assert python_exports(sources) == {
        "attr._make.attrs": ("attr.attrs", "attr.s", "attr.attributes"),
        "attr.validators.instance_of": ("attrs.validators.instance_of",),  # __all__ says what `*` takes
        "attr.filters.include": ("attrs.filters.include",),  # without __all__, the names not private
        "attr._next_gen.define": ("attrs.mutable", "attr._next_gen.mutable"),  # a package's name first
    }
    assert python_calls(sources) == {
        ("attr/__init__.py", "attr", 0): ("attr._make.attrs",),
        ("attrs/use.py", "attrs.use.make", 4): ("attr._make.attrs",),  # called by the bound name
    }


def test_a_name_a_module_assigns_is_published_with_its_chunk_where_a_package_imports_it() -> None:
    """An agent tester's pytest: pytest.skip, pytest.fail, pytest.mark and pytest.hookimpl (instances a module
    assigns, `skip = _Skip()`, re-exported by pytest/__init__.py) were "not indexed", and a wrong chunk answered
    at 0.9. They are published as names of the chunk assigning them; a function's local is not."""
    from ontofabric.services.ingest.graph import python_calls, python_exports
    from ontofabric.services.ingest.ingester import chunk_sources

    sources = {
        "_pytest/__init__.py": "",
        "_pytest/outcomes.py": "class _Skip: ...\nskip = _Skip()\nfail: object = _Skip()\n\n\n"
        "def f():\n    local = 1\n",
        "_pytest/mark/__init__.py": "from .structures import MARK_GEN\n",
        "_pytest/mark/structures.py": "class MarkGenerator: ...\nMARK_GEN = MarkGenerator()\n",
        "pytest/__init__.py": "from _pytest.outcomes import skip, fail, local\n"
        "from _pytest.mark import MARK_GEN as mark\nfrom _pytest.outcomes import *\n",
        "pytest/use.py": "from pytest import skip\n\n\ndef test():\n    skip()\n",
    }
    exports = python_exports(sources)
    assert exports["_pytest.outcomes.skip"][0] == "pytest.skip"
    assert exports["_pytest.outcomes.fail"] == ("pytest.fail",)
    assert exports["_pytest.mark.structures.MARK_GEN"] == ("pytest.mark", "_pytest.mark.MARK_GEN")
    assert not any(name.endswith(".local") for names in exports.values() for name in names)
    # A call of what a module assigns is a call of that name (an agent tester's callers of jinja2.utils.concat,
    # `concat = "".join`, were none): what calls pytest.skip is answered.
    assert python_calls(sources)[("pytest/use.py", "pytest.use.test", 4)] == ("_pytest.outcomes.skip",)
    chunks = {c.symbol_fqn: c for c in chunk_sources(Path("."), sources, 1 << 20)}
    assert chunks["_pytest.outcomes"].aliases == ("pytest.skip", "pytest.fail")
    assert chunks["_pytest.mark.structures"].aliases == ("pytest.mark", "_pytest.mark.MARK_GEN")
    # A review's: a value bound to another (`SETTINGS = DEFAULTS`) is its module's own, answered there with its line,
    # not published as the other's; and a package's own name for a constant was cut after 64 star imports'.
    bound = {"pkg/config.py": "DEFAULTS = {}\n", "pkg/m.py": "from .config import DEFAULTS\nSETTINGS = DEFAULTS\n"}
    assert python_exports(bound) == {}
    crowded = {
        "lib/__init__.py": "from ._core import skip\n",
        "lib/_core.py": "".join(f"C{n} = {n}\n" for n in range(20)) + "skip = object()\n",
        **{f"lib/m{n}.py": "from ._core import *\n" for n in range(4)},
    }
    with capture_logs() as logged:
        core = {c.symbol_fqn: c for c in chunk_sources(Path("."), crowded, 1 << 20)}["lib._core"]
    assert core.aliases[0] == "lib.skip"
    (cut,) = [entry for entry in logged if entry["event"] == "ingest_names_cut"]
    assert (cut["kind"], cut["names"], cut["kept"]) == ("published", 85, len(core.aliases))


def test_what_a_star_takes_is_what_python_takes_and_a_packages_own_name_goes_first() -> None:
    """A review's: a function's own import was published by `*`, another project's `numpy.core` was taken for the
    tree's `core`, examples taking a package by `*` pushed its own name out of those carried, and a chain of
    stars was not followed."""
    from ontofabric.services.ingest.graph import python_exports

    sources = {
        "mylib/__init__.py": "from .core import Engine\n",
        "mylib/core.py": "class Engine: ...\n\n\ndef helper():\n    from .inner import Hidden\n",
        "mylib/inner.py": "class Hidden: ...\n",
        "mylib/a.py": "from .core import *\n",  # no __all__ anywhere: the public names
        "mylib/b.py": "from .a import *\n",  # and through a
        "app/core.py": "class Engine: ...\n",
        "app/main.py": "from numpy.core import *\n",  # not the tree's core
        **{f"mylib/examples/ex{n:03}.py": "from mylib import *\n" for n in range(100)},
    }
    exports = python_exports(sources)
    assert "mylib.inner.Hidden" not in exports  # imported inside a function: no name of core
    engine = exports["mylib.core.Engine"]
    assert engine[0] == "mylib.Engine"  # the package's, before 100 examples' (and only so many are carried)
    assert {"mylib.a.Engine", "mylib.b.Engine"} <= set(engine)
    assert "mylib.a.helper" in exports["mylib.core.helper"]
    assert "app.core.Engine" not in exports


def test_calls_in_deeply_nested_functions_are_read_in_time_linear_in_the_file() -> None:
    """A review's: reading each nested function's locals walked its whole body again at every level, and 98 levels
    of nesting with 2,000 calls took 54 s (0.8 s before nested functions were read); nested functions deeper than
    NESTED_TYPED_DEPTH are not read for typed locals."""
    from ontofabric.services.ingest.graph import python_calls

    lines = ["class Builder:", "\tdef build(self): return 1", "", "def f0():"]
    for level in range(1, 98):
        lines += [f"{chr(9) * level}b{level} = Builder(); b{level}.build()", f"{chr(9) * level}def f{level}():"]
    lines += [f"{chr(9) * 98}x{j}.y()" for j in range(2000)] + [f"{chr(9) * 98}return 1"]
    started = time.perf_counter()
    calls = _by_name(python_calls({"pkg/__init__.py": "", "pkg/core.py": "\n".join(lines) + "\n"}))
    assert time.perf_counter() - started < 10.0  # quadratic in the depth: about a minute
    assert calls[("pkg/core.py", "pkg.core.f0")] == ("pkg.core.Builder", "pkg.core.Builder.build")
    from ontofabric.services.ingest.graph import _walked

    assert _walked.cache_info().currsize == 0  # each function's nodes are kept while its calls are read, no longer


def test_names_in_any_script_are_object_types_of_their_own() -> None:
    """A tester's ``class Животное`` and ``class Растение`` were both ``code.tiere.________``: one node, each
    subclass linked to it, and lookups by the names found nothing. Letters past ASCII are kept; what no name may
    hold (a zero-width space) is still ``_``."""
    from ontofabric.contracts import NodeUpserted, OntologyNode

    source = textwrap.dedent("""
        class Животное:
            pass

        class Растение:
            pass

        class Собака(Животное):
            pass

        class Роза(Растение):
            pass

        class Größe:
            pass

        class x·y:
            pass

        class x_y:
            pass
    """)
    nodes, links = python_graph({"code/tiere.py": source, "code/x\u200by.py": "class A:\n    pass\n"})
    types = {n.object_type for n in nodes}
    assert {"code.tiere.Животное", "code.tiere.Растение", "code.tiere.Größe", "code.x_y.A"} <= types
    assert {"code.tiere.x·y", "code.tiere.x_y"} <= types  # what continues an identifier too (a retest's were one)
    inherits = {(link.source_type, link.target_type) for link in links if link.name == "inherits"}
    assert inherits == {
        ("code.tiere.Собака", "code.tiere.Животное"),
        ("code.tiere.Роза", "code.tiere.Растение"),
    }
    for node in nodes:  # each a node the projector takes
        wire = OntologyNode(domain=node.domain, name=node.name, kind=node.kind)
        NodeUpserted.model_validate({"type": "node.upserted", "node": wire.model_dump(by_alias=True)})


def test_a_package_below_the_top_named_decomposed_is_imported_composed() -> None:
    """A review's: a ``src`` layout's package named with a decomposed accent was imported by its composed name
    (as Python reads it), and the import resolved to nothing."""
    _nodes, links = python_graph({
        "src/cafe\u0301/__init__.py": "",
        "src/cafe\u0301/pricing.py": "def total():\n    return 1\n",
        "src/app/__init__.py": "",
        "src/app/main.py": "from caf\u00e9.pricing import total\n",
    })  # fmt: skip
    assert ("src.app.main", "imports", "src.caf\u00e9.pricing") in {
        (k.source_type, k.name, k.target_type) for k in links
    }
