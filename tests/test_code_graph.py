"""The calls and graph of code in languages other than Python (services/ingest/code_graph.py): what each
language's syntax resolves, what it leaves out, and that every chunk they are read for is one the chunker makes."""

from __future__ import annotations

import textwrap
import threading
from pathlib import Path

import pytest

from ontofabric.contracts import CALLS, IMPORTS, INHERITS
from ontofabric.services.ingest.code import chunk_code
from ontofabric.services.ingest.code_graph import CallKey, CodeRead, go_module_path, read_code, rust_crate_name
from ontofabric.services.ingest.ingester import chunk_sources, go_modules, read_sources, reading_steps, rust_crates


def _calls(files: dict[str, str], go: dict[str, str] | None = None) -> dict[CallKey, list[str]]:
    sources = {path: textwrap.dedent(text).lstrip("\n") for path, text in files.items()}
    found = read_code(sources, go).calls
    chunks = {
        (c.file_path, c.symbol_fqn, c.line) for path, text in sources.items() for c in chunk_code(path, text, 10**6)
    }
    assert set(found) <= chunks, set(found) - chunks  # each is a chunk's, as the ingester looks it up
    return found


def _by_name(found: dict[CallKey, list[str]]) -> dict[str, list[str]]:
    return {fqn: names for (_path, fqn, _line), names in found.items()}


TYPESCRIPT = {
    "web/src/util/math.ts": """
        import { Base } from './base';
        export function add(a: number, b: number) { return a + b }
        /** A calculator. */
        export class Calc extends Base {
          total(): number { return this.sum() + super.base() + add(1, 2) + this.missing() }
          sum(): number { return add(0, 0) }
          base(): number { return 2 }
        }
        """,
    "web/src/util/base.ts": "export class Base {\n  base() { return 0 }\n  static make() { return new Base() }\n}\n",
    "web/src/util/index.ts": "export * from './math';\nexport { Base as Root } from './base';\n",
    "web/src/app.tsx": """
        import { add, Calc, Root } from './util';
        import * as m from './util/math.js';
        import start from './start';
        import React from 'react';
        const run = (add2: () => number) => {
          add(1, 2); m.add(3, 4); new Calc(); Root.make(); start(); add2(); React.createElement('p'); unknown.add()
        }
        export function main() { run(() => 1); main() }
        main();
        """,
    "web/src/start.js": "export default function start() { return helper() }\nfunction helper() { return 1 }\n",
    "web/src/legacy.js": """
        const { add: plus } = require('./util/math');
        const lib = require('./start');
        function go() { plus(1); lib.default(); lib.helper() }
        """,
}


def test_typescript_and_javascript_calls_resolve_through_imports_re_exports_and_classes() -> None:
    found = _by_name(_calls(TYPESCRIPT))
    assert found["web.src.app.run"] == [
        "web.src.util.math.add",  # through the index's `export *`
        "web.src.util.math.Calc",  # `new Calc()`
        "web.src.util.base.Base.make",  # `Root.make()`: a re-export under another name
        "web.src.start.start",  # a default import of a JavaScript file
    ]  # not the parameter add2, React's, nor a method of an object whose type the syntax does not say
    assert found["web.src.app.main"] == ["web.src.app.run"]  # not itself
    assert found["web.src.app"] == ["web.src.app.main"]  # the file's own statements
    # `this` through the class and its base (an own method first), `super` the base's alone, `./x.js` is x.ts.
    assert found["web.src.util.math.Calc.total"] == [
        "web.src.util.math.Calc.sum", "web.src.util.base.Base.base", "web.src.util.math.add"
    ]  # fmt: skip
    assert found["web.src.util.base.Base.make"] == ["web.src.util.base.Base"]
    assert found["web.src.start.start"] == ["web.src.start.helper"]
    # CommonJS: a destructured require under another name, and a module's names through it.
    assert found["web.src.legacy.go"] == ["web.src.util.math.add", "web.src.start.start", "web.src.start.helper"]


def test_typescript_decorators_are_calls_of_what_they_decorate_and_new_reads_a_namespace_import() -> None:
    """An agent tester's: a bare ``@audited`` was no call, ``@memoize(60_000)`` on a method was its class's, and
    ``new http.RetryPolicy()`` through ``import * as http`` was not read where ``http.retry()`` was."""
    found = _by_name(_calls({
        "src/deco.ts": "export function audited(t: any) {}\nexport function memoize(ms: number) { return audited }\n"
        "export const log = { trace(t: any) {} }\n",
        "src/http/policy.ts": "export class RetryPolicy { delay() {} }\nexport function retry() {}\n",
        "src/user.ts": """
            import { audited, memoize, log } from './deco';
            import * as http from './http/policy';

            @audited
            export class UserService {
              @audited
              @memoize(60_000)
              normalizeEmail(e: string) { return e }

              @audited
              // a comment between: still the method's (a review's went to the class)
              commented() {}

              connect() { const p = new http.RetryPolicy(); http.retry(); return p }

              again(q: http.RetryPolicy) { const p = new http.RetryPolicy(); p.delay(); q.delay() }
            }
            """,
    }))  # fmt: skip
    assert found["src.user.UserService.normalizeEmail"] == ["src.deco.audited", "src.deco.memoize"]
    assert found["src.user.UserService"] == ["src.deco.audited"]  # the class's own, not its method's
    assert found["src.user.UserService.commented"] == ["src.deco.audited"]
    assert found["src.user.UserService.connect"] == ["src.http.policy.RetryPolicy", "src.http.policy.retry"]
    # A local of `new ns.Class()` or annotated `: ns.Class`, through its class.
    assert found["src.user.UserService.again"] == ["src.http.policy.RetryPolicy", "src.http.policy.RetryPolicy.delay"]


def test_go_calls_resolve_within_the_package_through_imports_receivers_and_typed_parameters() -> None:
    files = {
        "svc/internal/store/store.go": """
            package store

            // Store keeps values.
            type Store struct{}

            func Open() *Store { return &Store{} }

            func (s *Store) Get(k string) string { return s.raw(k) }
            """,
        "svc/internal/store/raw.go": """
            package store

            func (s *Store) raw(k string) string { return helper(k) }

            func helper(k string) string { return k }
            """,
        "svc/cmd/main.go": """
            package main

            import (
            \tst "example.com/svc/internal/store"
            \t"fmt"
            )

            func serve(db *st.Store, helper func()) { db.Get("a"); fmt.Println(); helper() }

            func main() { s := st.Open(); serve(s, nil); s.Get("b") }
            """,
        "other/pkg/store/store.go": "package store\n\nfunc Open() int { return 0 }\n",
    }
    found = _by_name(_calls(files, {"svc": "example.com/svc"}))
    # `s.Get` through a local bound to what `st.Open()` returns (its declared result); `db.Get` by its parameter's.
    assert found["svc.cmd.main.main"] == [
        "svc.internal.store.store.Open", "svc.cmd.main.serve", "svc.internal.store.store.Store.Get"
    ]  # fmt: skip
    assert found["svc.cmd.main.serve"] == ["svc.internal.store.store.Store.Get"]  # not the parameter `helper`
    assert found["svc.internal.store.store.Store.Get"] == ["svc.internal.store.raw.Store.raw"]  # another file's
    assert found["svc.internal.store.raw.Store.raw"] == ["svc.internal.store.raw.helper"]
    # Without its go.mod, by the import path's end: the longest directory of Go files that ends it.
    assert _by_name(_calls(files))["svc.cmd.main.main"][:2] == ["svc.internal.store.store.Open", "svc.cmd.main.serve"]


def test_java_calls_resolve_through_the_class_its_bases_and_declared_types() -> None:
    files = {
        "src/com/acme/Tax.java": """
            package com.acme;

            public class Tax extends Base<Rates> implements Named {
              private Rates rates;
              public Tax() { this.rates = new Rates(); }
              public double compute(double x) { return rate() * x + this.rates.lookup() + helper() + name(); }
              double rate() { return Util.pi(); }
              static class Inner { double twice() { return rate() * 2; } }
            }
            """,
        "src/com/acme/Base.java": "package com.acme;\n\nclass Base<T> {\n  double helper() { return 0; }\n}\n",
        "src/com/acme/Named.java": """
            package com.acme;

            interface Named { default String name() { return ""; } }
            """,
        "src/com/acme/Rates.java": "package com.acme;\n\nclass Rates {\n  double lookup() { return 1; }\n}\n",
        "src/com/acme/util/Util.java": """
            package com.acme.util;

            public class Util { public static double pi() { return 3.14; } }
            """,
        "src/com/acme/App.java": """
            package com.acme;

            import com.acme.util.Util;

            class App {
              void main(Tax t) { Tax u = new Tax(); u.compute(1); t.rate(); Util.pi(); java.util.List.of(); }
            }
            """,
    }
    found = _by_name(_calls(files))
    assert found["src.com.acme.App.App.main"] == [
        "src.com.acme.Tax.Tax", "src.com.acme.Tax.Tax.compute", "src.com.acme.Tax.Tax.rate",
        "src.com.acme.util.Util.Util.pi",
    ]  # fmt: skip
    assert found["src.com.acme.Tax.Tax.compute"] == [
        "src.com.acme.Tax.Tax.rate", "src.com.acme.Rates.Rates.lookup", "src.com.acme.Base.Base.helper",
        "src.com.acme.Named.Named.name",
    ]  # fmt: skip
    assert found["src.com.acme.Tax.Tax.constructor"] == ["src.com.acme.Rates.Rates"]
    assert "src.com.acme.Tax.Tax.rate" not in found  # Util is not imported by Tax.java: not the tree's Util
    assert found["src.com.acme.Tax.Tax.Inner.twice"] == ["src.com.acme.Tax.Tax.rate"]  # the enclosing class's


def test_rust_calls_resolve_through_modules_uses_impls_and_macros() -> None:
    files = {
        "crates/net/src/lib.rs": """
            mod tcp;
            use crate::tcp::{connect, Conn as C};

            macro_rules! hi { () => {} }

            pub fn run() { connect(); C::new(); tcp::connect(); hi!(); inner::f(); std::process::exit(0); }

            mod inner {
                pub fn f() { super::run(); g() }
                fn g() {}
            }
            """,
        "crates/net/src/tcp.rs": """
            pub struct Conn;

            impl Conn {
                pub fn new() -> Self { Self::init(); Conn }
                fn init() {}
                pub fn send(&self) { self.flush() }
                fn flush(&self) {}
            }

            pub fn connect() { super::run(); Conn::new(); }
            """,
        "crates/other/src/lib.rs": "pub fn connect() {}\npub fn run() { connect() }\n",
    }
    found = _by_name(_calls(files))
    assert found["crates.net.src.lib.run"] == [
        "crates.net.src.tcp.connect", "crates.net.src.tcp.Conn.new", "crates.net.src.lib.hi",
        "crates.net.src.lib.inner.f",
    ]  # fmt: skip
    assert found["crates.net.src.lib.inner.f"] == ["crates.net.src.lib.run", "crates.net.src.lib.inner.g"]
    assert found["crates.net.src.tcp.Conn.new"] == ["crates.net.src.tcp.Conn.init"]
    assert found["crates.net.src.tcp.Conn.send"] == ["crates.net.src.tcp.Conn.flush"]
    assert found["crates.net.src.tcp.connect"] == ["crates.net.src.lib.run", "crates.net.src.tcp.Conn.new"]
    assert found["crates.other.src.lib.run"] == ["crates.other.src.lib.connect"]  # its own crate's


def test_what_the_syntax_cannot_tell_is_left_out() -> None:
    minified = "export function a(){return b()}function b(){return 1}" + "x" * 400 + "\n"
    assert read_code({"dist/bundle.js": minified * 3}).calls == {}  # a bundle is its file's chunk alone
    broken = _by_name(_calls({"a.ts": "function f() { g() }\nfunction g() {}\nlet = ;\n"}))  # a syntax error
    assert broken.get("a.f") == ["a.g"]
    assert read_code({"README.md": "f()"}) == CodeRead({}, [], [], {})


def test_the_ingester_reads_go_modules_and_carries_the_calls(tmp_path: Path) -> None:
    assert go_module_path('// generated\nmodule "example.com/x/v2"\n\ngo 1.22\n') == "example.com/x/v2"
    (tmp_path / "svc" / "cmd").mkdir(parents=True)
    (tmp_path / "svc" / "go.mod").write_text("module example.com/svc\n")
    files = {
        "svc/cmd/main.go": 'package main\n\nimport "example.com/svc/lib"\n\nfunc main() { lib.Do() }\n',
        "svc/lib/lib.go": "package lib\n\nfunc Do() {}\n",
    }
    assert go_modules(tmp_path, files) == {"svc": "example.com/svc"}
    chunks = chunk_sources(tmp_path, files, 10**6)
    called = {c.symbol_fqn: c.calls for c in chunks if c.calls}
    assert called == {"svc.cmd.main.main": ("svc.lib.lib.Do",)}


def test_rust_declarations_are_also_named_by_their_path_in_the_crate(tmp_path: Path) -> None:
    """An agent tester's ``backoff::Backoff`` and ``throttle::clock::Clock`` were not found by name: the chunks
    were named after the file's path alone (``src.backoff.mod.Backoff``)."""
    (tmp_path / "throttle").mkdir()
    (tmp_path / "throttle" / "Cargo.toml").write_text('[package]\nname = "throttle"\n')
    files = {
        "throttle/src/lib.rs": "pub mod backoff;\npub fn run() {}\n",
        "throttle/src/backoff/mod.rs": "pub trait Backoff { fn next(&self) -> u64; }\n",
        "throttle/src/clock.rs": "pub struct Clock;\n",
        "loose/src/util.rs": "pub fn helper() {}\n",  # no Cargo.toml: no crate name
        "throttle/src/bin/tool.rs": "fn main() {}\n",  # a binary crate of its own: no module of the library
    }
    named = {c.symbol_fqn: c.aliases for c in chunk_sources(tmp_path, files, 10**6)}
    assert named == {
        "throttle.src.lib": ("throttle",),
        "throttle.src.lib.run": ("throttle.run",),
        "throttle.src.backoff.mod": ("backoff", "throttle.backoff"),
        "throttle.src.backoff.mod.Backoff": ("backoff.Backoff", "throttle.backoff.Backoff"),
        "throttle.src.backoff.mod.Backoff.next": ("backoff.Backoff.next", "throttle.backoff.Backoff.next"),
        "throttle.src.clock": ("throttle.clock",),
        "throttle.src.clock.Clock": ("throttle.clock.Clock",),
        "loose.src.util": (),
        "loose.src.util.helper": (),
        "throttle.src.bin.tool": (),
        "throttle.src.bin.tool.main": (),
    }


def _graph(files: dict[str, str]) -> CodeRead:
    return read_code({path: textwrap.dedent(text).lstrip("\n") for path, text in files.items()})


def test_the_graph_holds_files_and_types_with_imports_inheritance_and_calls() -> None:
    read = _graph(TYPESCRIPT)
    nodes = {node.object_type: node for node in read.nodes}
    assert nodes["web.src.util.math"].kind == "module"
    assert nodes["web.src.util.math.Calc"].kind == "class"
    assert nodes["web.src.util.math.Calc"].interfaces == ("web.src.util.base.Base",)
    links = {(link.source_type, link.name, link.target_type) for link in read.links}
    assert ("web.src.util.math.Calc", INHERITS, "web.src.util.base.Base") in links
    # An import, a re-export and a require each link the file to the file they name; a package's, nothing.
    assert {("web.src.app", IMPORTS, "web.src.util.index"), ("web.src.app", IMPORTS, "web.src.util.math"),
            ("web.src.app", IMPORTS, "web.src.start"), ("web.src.util.index", IMPORTS, "web.src.util.base"),
            ("web.src.legacy", IMPORTS, "web.src.util.math")} <= links  # fmt: skip
    assert not {link for link in links if link[0] == "web.src.app" and link[1] == IMPORTS} - {
        ("web.src.app", IMPORTS, "web.src.util.index"), ("web.src.app", IMPORTS, "web.src.util.math"),
        ("web.src.app", IMPORTS, "web.src.start"),
    }  # fmt: skip
    # Calls between the types holding them: a module's function calling a class's method, a class's own calls.
    assert ("web.src.app", CALLS, "web.src.util.base.Base") in links  # Root.make()
    assert ("web.src.util.math.Calc", CALLS, "web.src.util.base.Base") in links  # super.base()
    assert read.defined_in["web.src.util.math.Calc"] == "web/src/util/math.ts"
    assert read.defined_in["web.src.app"] == "web/src/app.tsx"


def test_java_go_and_rust_imports_and_bases_are_links() -> None:
    java = _graph({
        "src/com/acme/Tax.java": "package com.acme;\nimport com.acme.util.Util;\nimport java.util.List;\n"
        "class Tax extends Base implements Named, java.io.Serializable {}\n",
        "src/com/acme/Base.java": "package com.acme;\nclass Base {}\n",
        "src/com/acme/Named.java": "package com.acme;\ninterface Named {}\n",
        "src/com/acme/util/Util.java": "package com.acme.util;\npublic class Util {}\n",
        "src/com/acme/util/More.java": "package com.acme.util;\npublic class More {}\n",
        "src/com/acme/App.java": "package com.acme;\nimport com.acme.util.*;\nclass App {}\n",
    })  # fmt: skip
    links = {(link.source_type, link.name, link.target_type) for link in java.links}
    assert {("src.com.acme.Tax.Tax", INHERITS, "src.com.acme.Base.Base"),
            ("src.com.acme.Tax.Tax", INHERITS, "src.com.acme.Named.Named"),
            ("src.com.acme.Tax", IMPORTS, "src.com.acme.util.Util")} <= links  # fmt: skip
    assert not {link for link in links if link[0] == "src.com.acme.App"}  # a package imported whole: no link
    tax = next(node for node in java.nodes if node.object_type == "src.com.acme.Tax.Tax")
    assert tax.interfaces == ("src.com.acme.Base.Base", "src.com.acme.Named.Named", "java.io.Serializable")
    go = _graph({
        "cmd/main.go": 'package main\n\nimport "example.com/x/store"\n\nfunc main() { store.Open() }\n',
        "store/a.go": "package store\n\nfunc Open() {}\n",
        "store/store.go": "package store\n\nfunc Close() {}\n",
        "store/z.go": "package store\n\nfunc Flush() {}\n",
    })  # fmt: skip
    links = {(link.source_type, link.name, link.target_type) for link in go.links}
    # The package by the file named as it is, one link (each file's would be many); its calls by their file.
    assert {link for link in links if link[:2] == ("cmd.main", IMPORTS)} == {("cmd.main", IMPORTS, "store.store")}
    assert ("cmd.main", CALLS, "store.a") in links
    rust = _graph({
        "src/lib.rs": "mod net;\nuse crate::net::tcp::Conn;\npub fn run() { Conn::open() }\n",
        "src/net/mod.rs": "pub mod tcp;\n",
        "src/net/tcp.rs": "pub struct Conn;\nimpl Conn { pub fn open() {} }\n",
    })  # fmt: skip
    links = {(link.source_type, link.name, link.target_type) for link in rust.links}
    assert ("src.lib", IMPORTS, "src.net.tcp") in links


def test_rust_trait_implementations_are_bases() -> None:
    """An outside agent's "what implements Backoff" found none: ``impl Trait for Type`` was read for its methods
    only. The trait is found as the impl's module names it: its own, a ``use``, a path, the crate's one of the
    name; a trait of no module of the tree (``Display``) is no link."""
    read = _graph({
        "src/lib.rs": "pub mod backoff;\npub mod clock;\nmod wrap;\n",
        "src/backoff/mod.rs": "pub mod fixed;\npub trait Backoff { fn next(&self) -> u64; }\n",
        "src/backoff/fixed.rs": "use crate::backoff::Backoff;\npub struct Fixed;\n"
        "impl Backoff for Fixed { fn next(&self) -> u64 { 1 } }\n"
        "impl std::fmt::Display for Fixed {}\n",
        "src/clock.rs": "pub trait Clock {}\npub struct System;\nimpl Clock for System {}\n"
        "mod mock {\n    pub struct Mock;\n    impl crate::clock::Clock for Mock {}\n}\n"
        "pub trait Precise: Clock + Send + 'static {}\n",
        "src/wrap.rs": "use crate::clock::System;\npub struct Wrapped<C>(C);\n"
        "impl<C: Clock> super::backoff::Backoff for Wrapped<C> { fn next(&self) -> u64 { 2 } }\n"
        "impl Clock for System {}\n",
    })  # fmt: skip
    inherits = {(link.source_type, link.target_type) for link in read.links if link.name == INHERITS}
    assert inherits == {
        ("src.backoff.fixed.Fixed", "src.backoff.mod.Backoff"),
        ("src.clock.System", "src.clock.Clock"),
        ("src.clock.mock.Mock", "src.clock.Clock"),
        ("src.wrap.Wrapped", "src.backoff.mod.Backoff"),
        ("src.clock.Precise", "src.clock.Clock"),  # a supertrait; Send, of no module of the tree, none
    }
    # A trait `use`d from outside the tree, or the prelude's, is no type of the crate of its name (a review's).
    outside = _graph({
        "src/lib.rs": "mod error;\nmod other;\nmod a;\nmod c;\n",
        "src/error.rs": "pub enum Error { A }\n",
        "src/other.rs": "use std::error::Error;\npub struct Other;\nimpl Error for Other {}\n",
        "src/a.rs": "pub struct Iterator;\n",
        "src/c.rs": "pub struct S;\nimpl Iterator for S {}\n",
    })  # fmt: skip
    assert not [link for link in outside.links if link.name == INHERITS]


GO_STORES = {
    "inv/store/store.go": """
        package store

        // Store keeps items.
        type Store interface {
        \tGet(id string) (Item, error)
        \tPut(it Item) error
        }

        type Closer interface {
        \tStore
        \tClose() error
        }

        type Open interface {
        \tio.Reader
        \tGet(id string) (Item, error)
        }

        type Number interface{ ~int | ~float64 }

        type Any interface{}

        type Item struct{ ID string }
        """,
    "inv/store/memory.go": """
        package store

        type MemoryStore struct{ items map[string]Item }

        func (m *MemoryStore) Get(id string) (Item, error) { return m.items[id], nil }

        func (m *MemoryStore) Put(it Item) error { return nil }
        """,
    "inv/cached/cached.go": """
        package cached

        import "example.com/inv/store"

        type CachedStore struct {
        \t*store.MemoryStore
        \thits int
        }

        func (c *CachedStore) Close() error { return nil }

        type Getter struct{}

        func (g Getter) Get(id string) (store.Item, error) { return store.Item{}, nil }
        """,
    "inv/audit/audit.go": """
        package audit

        import (
        \t"example.com/inv/cached"
        \t"example.com/inv/store"
        )

        func Audit(st store.Store, c *cached.CachedStore) { st.Get("a"); c.Put(store.Item{}) }

        type Auditor struct {
        \tst, backup store.Store
        \t*cached.CachedStore
        }

        func (a *Auditor) Run() { a.backup.Put(store.Item{}); a.CachedStore.Close(); a.MemoryStore.Get("b") }
        """,
}


def test_go_types_implement_the_interfaces_whose_methods_they_have_and_embed_their_bases() -> None:
    """An agent tester's "what implements Store" found none of its stores (Go says it nowhere), and what calls
    ``Store.Get`` was "not indexed": an interface's methods were no chunks, so calls through a parameter of an
    interface type were lost."""
    sources = {path: textwrap.dedent(text).lstrip("\n") for path, text in GO_STORES.items()}
    read = read_code(sources, {"inv": "example.com/inv"})
    inherits = {(link.source_type, link.target_type) for link in read.links if link.name == INHERITS}
    assert inherits == {
        ("inv.store.memory.MemoryStore", "inv.store.store.Store"),
        ("inv.cached.cached.CachedStore", "inv.store.memory.MemoryStore"),  # embedded, through its package
        ("inv.cached.cached.CachedStore", "inv.store.store.Store"),  # through what it embeds
        ("inv.cached.cached.CachedStore", "inv.store.store.Closer"),  # its own Close too
        ("inv.store.store.Closer", "inv.store.store.Store"),  # an interface embedding another
        ("inv.audit.audit.Auditor", "inv.cached.cached.CachedStore"),
        ("inv.audit.audit.Auditor", "inv.store.store.Store"),
        ("inv.audit.audit.Auditor", "inv.store.store.Closer"),
    }  # not Getter (no Put); not Open (none has io.Reader's Read), Number, nor the empty Any
    cached = next(node for node in read.nodes if node.object_type == "inv.cached.cached.CachedStore")
    assert set(cached.interfaces) == {"inv.store.memory.MemoryStore", "inv.store.store.Store", "inv.store.store.Closer"}
    found = _by_name(_calls(GO_STORES, {"inv": "example.com/inv"}))
    # Through an interface's parameter, its method; through an embedded struct, the method it promotes.
    assert found["inv.audit.audit.Audit"] == ["inv.store.store.Store.Get", "inv.store.memory.MemoryStore.Put"]
    # Through a struct's field, an embedded one named by its type, and one it has through what it embeds (a
    # retest's dependency-injected stores were no callers).
    assert found["inv.audit.audit.Auditor.Run"] == [
        "inv.store.store.Store.Put", "inv.cached.cached.CachedStore.Close", "inv.store.memory.MemoryStore.Get"
    ]  # fmt: skip
    # A field two embedded structs have, the shallowest's, as Go reads it (a review's was found depth first).
    shallow = _by_name(_calls({"f/f.go": """
        package f

        type Deep struct{}

        func (Deep) Get() {}

        type Shallow struct{}

        func (Shallow) Get() {}

        type Inner struct{ store Deep }

        type A struct{ Inner }

        type Other struct{ store Shallow }

        type Outer struct {
        \tA
        \tOther
        }

        func (o Outer) Sync() { o.store.Get() }

        type C struct{}

        func (C) Name() {}

        type B struct{}

        func (B) Name() {}

        type Left struct{ C }

        type AB struct {
        \tLeft
        \tB
        }

        func Describe(ab AB) { ab.Name() }
        """}))  # fmt: skip
    assert shallow["f.f.Outer.Sync"] == ["f.f.Shallow.Get"]
    assert shallow["f.f.Describe"] == ["f.f.B.Name"]  # promoted from the shallower (a retest's got C's)
    chunks = {c.symbol_fqn for c in chunk_code("inv/store/store.go", sources["inv/store/store.go"], 10**6)}
    assert {"inv.store.store.Store.Get", "inv.store.store.Store.Put", "inv.store.store.Closer.Close"} <= chunks


def test_a_go_interface_is_implemented_by_signature_and_its_unexported_methods_package_whatever_the_order() -> None:
    """A review's: a type of another package was linked to a sealed interface (``exprNode()``, which only its own
    package can implement), ``Run()`` to ``Run(ctx) error``, and a chain of interfaces embedding each other linked
    a type to the last two or to all eleven by the order they were declared in."""
    chain = "\n".join(
        f"type I{i} interface {{\n\tM{i}()\n" + (f"\tI{i + 1}\n" if i < 10 else "") + "}\n" for i in range(11)
    )
    implementing = "type T struct{}\n" + "".join(f"func (T) M{i}() {{}}\n" for i in range(11))
    for order in (chain, "\n".join(reversed(chain.split("\n\n")))):
        files = {
            "ast/ast.go": "package ast\n\ntype Expr interface{ exprNode() }\n\ntype Ident struct{}\n\n"
            "func (Ident) exprNode() {}\n\ntype Base struct{}\n\nfunc (*Base) exprNode() {}\n",
            "other/other.go": 'package other\n\nimport "example.com/m/ast"\n\ntype Thing struct{}\n\n'
            "func (Thing) exprNode() {}\n\ntype Wrapped struct{ *ast.Base }\n\n"
            "type Runner interface{ Run(ctx context.Context) error }\n\ntype Job struct{}\n\nfunc (Job) Run() {}\n\n"
            "type Task struct{}\n\nfunc (Task) Run(c context.Context) error { return nil }\n",
            "chain/chain.go": f"package chain\n\n{order}\n{implementing}",
        }
        read = read_code(files, {"": "example.com/m"})
        inherits = {(link.source_type, link.target_type) for link in read.links if link.name == INHERITS}
        assert {(s, t) for s, t in inherits if t == "ast.ast.Expr"} == {
            ("ast.ast.Ident", "ast.ast.Expr"), ("ast.ast.Base", "ast.ast.Expr"),
            ("other.other.Wrapped", "ast.ast.Expr"),  # its exprNode is ast's, through what it embeds
        }  # fmt: skip
        assert {s for s, t in inherits if t == "other.other.Runner"} == {"other.other.Task"}
        assert {t for s, t in inherits if s == "chain.chain.T"} == {f"chain.chain.I{i}" for i in range(11)}


def test_a_go_interface_is_implemented_by_its_methods_types_not_their_number_alone() -> None:
    """A review's: matched by number alone, ``Get(K) (V, bool)`` took ``Get(string) ([]byte, error)`` for itself.
    A type parameter's place takes any type; a type written ``store.Key`` in one package is ``Key`` in its own."""
    files = {
        "store/store.go": "package store\n\ntype Key string\n\n"
        "type Getter[K comparable, V any] interface{ Get(K) (V, bool) }\n\n"
        "type Putter interface{ Put(k Key, values ...[]byte) error }\n\n"
        "type Logger interface{ Logf(format string, args ...any) }\n\n"
        "type Setter interface{ Set(map[string]any) }\n\n"
        "type Combiner interface{ Combine(func(int, int) int, []byte) }\n",
        "mem/mem.go": 'package mem\n\nimport "example.com/m/store"\n\n'
        "type Cache struct{}\n\nfunc (c *Cache) Get(name string) (data []byte, found bool) { return }\n\n"
        "func (c *Cache) Put(key store.Key, vs ...[]byte) error { return nil }\n\n"
        "type Disk struct{}\n\nfunc (Disk) Get(string) ([]byte, error) { return nil, nil }\n\n"
        "func (Disk) Put(key string, vs ...[]byte) error { return nil }\n\n"
        "type Set[T comparable] struct{}\n\nfunc (s Set[T]) Get(item T) (T, bool) { var t T; return t, false }\n\n"
        "type Printer struct{}\n\nfunc (Printer) Logf(format string, args ...interface{}) {}\n\n"
        "type Tracer struct{}\n\nfunc (Tracer) Logf(format string, args []any) {}\n\n"
        "type Config struct{}\n\nfunc (Config) Set(values map[string]interface{}) {}\n\n"
        "type Adder struct{}\n\nfunc (Adder) Combine(f func(a, b int) int, data []uint8) {}\n",
    }
    read = read_code(files, {"": "example.com/m"})
    inherits = {(link.source_type, link.target_type) for link in read.links if link.name == INHERITS}
    assert {(s, t) for s, t in inherits if t.startswith("store.")} == {
        ("mem.mem.Cache", "store.store.Getter"),  # a type parameter takes string and []byte
        ("mem.mem.Set", "store.store.Getter"),  # its own type parameter takes the interface's
        ("mem.mem.Cache", "store.store.Putter"),  # store.Key is Key
        ("mem.mem.Printer", "store.store.Logger"),  # interface{} is any
        ("mem.mem.Config", "store.store.Setter"),  # within a map too (a review's)
        ("mem.mem.Adder", "store.store.Combiner"),  # a, b int is int, int; uint8 is byte
    }  # not Disk (an error is no bool, a string no Key), nor Tracer (a slice is no variadic)


def test_a_go_interface_embedding_the_standard_librarys_is_implemented_by_the_types_with_its_methods() -> None:
    """``type Source interface{ io.Reader; Name() string }`` had methods unknown here, so no type implemented it;
    a struct embedding ``io.Reader`` has its ``Read`` too."""
    files = {
        "src/src.go": 'package src\n\nimport (\n\t"io"\n\tstdhttp "net/http"\n)\n\n'
        "type Source interface {\n\tio.ReadCloser\n\tName() string\n}\n\n"
        "type Failure interface {\n\terror\n\tCode() int\n}\n\n"
        "type Route interface {\n\tstdhttp.Handler\n\tPath() string\n}\n\n"
        "type Wrapped interface{ io.Reader; Other() }\n\n"  # io.Reader's, since no `Reader` is this tree's
        "type File struct{}\n\nfunc (*File) Read(p []byte) (int, error) { return 0, nil }\n\n"
        'func (*File) Close() error { return nil }\n\nfunc (*File) Name() string { return "" }\n\n'
        "type Tee struct {\n\tio.Reader\n}\n\nfunc (Tee) Close() error { return nil }\n\n"
        'func (Tee) Name() string { return "" }\n\n'
        "type Half struct{}\n\nfunc (Half) Read(p []byte) error { return nil }\n\n"
        "func (Half) Close() error { return nil }\n\n"
        'func (Half) Name() string { return "" }\n\n'
        'type NotFound struct{}\n\nfunc (NotFound) Error() string { return "" }\n\n'
        "func (NotFound) Code() int { return 404 }\n\n"
        "type Home struct{}\n\nfunc (Home) ServeHTTP(w stdhttp.ResponseWriter, r *stdhttp.Request) {}\n\n"
        'func (Home) Path() string { return "/" }\n',
    }
    read = read_code(files, {"": "example.com/m"})
    inherits = {(link.source_type, link.target_type) for link in read.links if link.name == INHERITS}
    assert inherits == {
        ("src.src.File", "src.src.Source"),
        ("src.src.Tee", "src.src.Source"),  # its Read is the io.Reader it embeds
        ("src.src.NotFound", "src.src.Failure"),
        ("src.src.Home", "src.src.Route"),  # net/http imported as stdhttp
    }  # not Half: its Read returns no int


def test_a_typescript_namespaces_functions_and_classes_are_called_through_its_name() -> None:
    """An agent tester's ``Validation.isEmail()``, the namespace imported by name, called nothing; nor did one
    declared in the same file, nor a nested one."""
    found = _by_name(_calls({
        "src/validation.ts": """
            export namespace Validation {
              export function isEmail(s: string): boolean { return true; }
              export namespace Inner {
                export function deep(): void {}
                export class Rules { static check(): void {} }
              }
            }
            """,
        "src/user.ts": """
            import { Validation } from "./validation";
            import * as v from "./validation";
            export function check(s: string): boolean {
              Validation.Inner.deep();
              new Validation.Inner.Rules();
              Validation.Inner.Rules.check();
              v.Validation.isEmail(s);
              Validation.missing();
              return Validation.isEmail(s);
            }
            export function shadowed(Validation: any): void { Validation.isEmail(""); }
            """,
        "src/same.ts": "namespace Local { export function helper(): void {} }\n"
        "export function useIt(): void { Local.helper(); }\n",
    }))  # fmt: skip
    space = "src.validation.Validation"
    assert found["src.user.check"] == [
        f"{space}.Inner.deep", f"{space}.Inner.Rules", f"{space}.Inner.Rules.check", f"{space}.isEmail"
    ]  # fmt: skip
    assert "src.user.shadowed" not in found  # a parameter of the name is no namespace
    assert found["src.same.useIt"] == ["src.same.Local.helper"]


def test_a_go_packages_stand_in_file_is_named_by_the_package_its_directory_holds() -> None:
    """Not a ``go:generate`` helper's ``main`` beside it, nor a ``_test`` package (a review's)."""
    read = read_code({
        "pkg/colors/gen_colors.go": "//go:build ignore\n\npackage main\n\nfunc main() {}\n",
        "pkg/colors/palette.go": "package colors\n\nfunc Red() {}\n",
        "pkg/colors/table.go": "package colors\n\nfunc Blue() {}\n",
        "pkg/colors/palette_test.go": "package colors_test\n\nfunc TestRed() {}\n",
        "cmd/app/main.go": "package main\n\nfunc main() {}\n",
    })  # fmt: skip
    assert read.package_names == {"pkg/colors/palette.go": ("pkg.colors", "colors")}


def test_a_one_line_go_interface_past_the_minified_width_keeps_its_chunk() -> None:
    methods = "; ".join(f"Method{i}(ctx context.Context, id string) error" for i in range(8))
    text = f"package p\n\ntype Service interface{{ {methods} }}\n"
    assert len(text.splitlines()[2]) > 300
    assert {c.symbol_fqn for c in chunk_code("p/p.go", text, 10**6)} == {"p.p", "p.p.Service"}


def test_hostile_trees_end_and_stop_nothing() -> None:
    # Index files re-exporting each other all: a name none exports took 15 s for 10 files (the files to the power
    # of the hops followed); each (file, name) is now looked up once, and a cycle ends.
    files = {f"lib/i{n}.ts": "".join(f"export * from './i{m}';\n" for m in range(12) if m != n) for n in range(12)}
    files["lib/i11.ts"] += "export function real() { return 1 }\n"
    files["app.ts"] = "import { real, missing } from './lib/i0';\nexport function main() { missing(); real() }\n"
    done: list[dict[str, list[str]]] = []
    worker = threading.Thread(target=lambda: done.append(_by_name(_calls(files))), daemon=True)
    worker.start()
    worker.join(60)
    assert done, "still looking up after 60 s"
    assert done[0]["app.main"] == ["lib.i11.real"]
    # A `use` list a thousand deep (8 kB) ended the whole tree's ingest with a RecursionError.
    deep = "fn f() {}\nuse " + "self::{" * 1000 + "f" + "}" * 1000 + ";\nfn g() { f(); }\n"
    assert _by_name(_calls({"src/lib.rs": deep}))["src.lib.g"] == ["src.lib.f"]


def test_a_go_mod_says_which_imports_are_the_trees() -> None:
    files = {
        "main.go": 'package main\n\nimport "github.com/pkg/errors"\n\nfunc main() { errors.Wrap() }\n',
        "errors/errors.go": "package errors\n\nfunc Wrap() {}\n",
    }
    assert "main.main" not in _by_name(_calls(files, {"": "example.com/app"}))  # another module's errors
    assert _by_name(_calls(files))["main.main"] == ["errors.errors.Wrap"]  # no go.mod: by the path's end
    assert go_module_path("module\n\ngo 1.21\n") is None
    assert go_module_path("/* module fake.org/y */\n// module other.org/z\nmodule real.org/x\n") == "real.org/x"


def test_rust_types_of_one_name_in_two_modules_are_two() -> None:
    conn = "pub struct Conn;\nimpl Conn {\n    pub fn new() -> Conn { Conn }\n    fn go(&self) { Self::new(); }\n}\n"
    found = _by_name(_calls({
        "c/src/lib.rs": "mod a;\nmod b;\nuse crate::b::Conn;\npub fn top() { a::Conn::new(); b::Conn::new(); }\n"
        "pub fn other() { Conn::new() }\n",
        "c/src/a.rs": conn,
        "c/src/b.rs": conn,
        # A type with an associated type (`impl Iterator`): `Chain::new()` through a `use` was not found.
        "c/src/chain.rs": "pub struct Chain;\nimpl Chain { pub fn new() -> Self { Chain } }\n"
        "impl Iterator for Chain {\n    type Item = u8;\n    fn next(&mut self) -> Option<u8> { None }\n}\n",
        "c/src/user.rs": "use crate::chain::Chain;\npub fn walk() { Chain::new(); }\n",
    }))  # fmt: skip
    assert found["c.src.lib.top"] == ["c.src.a.Conn.new", "c.src.b.Conn.new"]
    assert found["c.src.lib.other"] == ["c.src.b.Conn.new"]
    assert found["c.src.a.Conn.go"] == ["c.src.a.Conn.new"]
    assert found["c.src.b.Conn.go"] == ["c.src.b.Conn.new"]
    assert found["c.src.user.walk"] == ["c.src.chain.Chain.new"]


def test_names_the_code_binds_itself_are_not_the_files() -> None:
    typescript = _by_name(_calls({
        "a.ts": """
            export function helper() { return 1 }
            export function local() { const helper = () => 2; return helper() }
            export function inner() { function helper() { return 3 } return helper() }
            export function mapped(xs: string[]) { return xs.map((helper) => helper()) }
            export function outer() { return helper() }
            """,
    }))  # fmt: skip
    assert typescript == {"a.outer": ["a.helper"]}
    go = _by_name(_calls({
        "p/a.go": """
            package p

            func helper() {}

            type Server struct{}

            func (s *Server) Start() {}

            func local(fs []func()) {
            \thelper := func() {}
            \thelper()
            \tfor _, f := range fs { f() }
            \tsrv := &Server{}
            \tsrv.Start()
            }

            func outer() { helper() }
            """,
    }))  # fmt: skip
    assert go["p.a.local"] == ["p.a.Server.Start"]  # a composite literal's type is written
    assert go["p.a.outer"] == ["p.a.helper"]
    rust = _by_name(_calls({"src/lib.rs": "fn helper() {}\nfn local() { let helper = || 1; helper(); }\n"}))
    assert "src.lib.local" not in rust


def test_java_reads_a_names_type_in_its_scope_static_imports_and_nested_types() -> None:
    files = {
        "src/a/Y.java": "package a;\n\nclass Y {\n  void run() {}\n  static class Builder { void add() {} }\n}\n",
        "src/a/Z.java": "package a;\n\nclass Z {\n  void run() {}\n}\n",
        "src/a/Util.java": "package a;\n\nclass Util {\n  static void check() {}\n  static void other() {}\n}\n",
        "src/a/I.java": "package a;\n\ninterface J { default void j() {} }\n\n"
        "interface I extends J { default void i() { j(); } }\n",
        "src/a/K.java": """
            package a;

            import static a.Util.check;

            class K extends Y {
              Y field;
              Y.Builder builder;
              K() { super(); }
              void both() { { Y v = null; v.run(); } { Z v = null; v.run(); } }
              void shadow() { Z field = null; field.run(); }
              void viaField() { field.run(); builder.add(); }
              void statics() { check(); other(); }
              void anonymous() { Runnable r = new Runnable() { public void run() { both(); } }; }
            }
            """,
    }
    found = _by_name(_calls(files))
    assert found["src.a.K.K.both"] == ["src.a.Y.Y.run", "src.a.Z.Z.run"]  # each block's v
    assert found["src.a.K.K.shadow"] == ["src.a.Z.Z.run"]  # the local, not the field
    assert found["src.a.K.K.viaField"] == ["src.a.Y.Y.run", "src.a.Y.Y.Builder.add"]  # Y.Builder, not Y
    assert found["src.a.K.K.statics"] == ["src.a.Util.Util.check"]  # imported by name: other() is not
    assert found["src.a.K.K.constructor"] == ["src.a.Y.Y"]  # super(): the base class
    assert "src.a.K.K.anonymous" not in found  # the anonymous class's both(), not K's
    assert found["src.a.I.I.i"] == ["src.a.I.J.j"]  # an interface's extends


def test_typescript_this_super_and_private_members() -> None:
    found = _by_name(_calls({
        "k.ts": """
            export class Base { constructor(public n: number) {} }
            export class Ky extends Base {
              constructor() { super(1) }
              #retry() { return 1 }
              fetch() { return this.#retry() }
              later() { setTimeout(function () { this.fetch() }); return () => this.fetch() }
            }
            """,
    }))  # fmt: skip
    assert found["k.Ky.constructor"] == ["k.Base"]
    assert found["k.Ky.fetch"] == ["k.Ky.retry"]  # a private member is named without its `#`
    assert found["k.Ky.later"] == ["k.Ky.fetch"]  # the arrow function's this, not the function's


def test_rust_reads_a_crate_by_its_name_and_through_its_re_exports(tmp_path: Path) -> None:
    files = {
        "src/lib.rs": "mod error;\npub use crate::error::Error;\n",
        "src/error.rs": "pub struct Error;\nimpl Error {\n    pub fn new() -> Self { Error }\n    pub fn msg() {}\n}\n",
        "tests/test_a.rs": "use my_lib::Error;\nfn t() { Error::new(); my_lib::Error::msg(); other::Error::new(); }\n",
    }
    found = _by_name(read_code(files, rust_crates={"": "my_lib"}).calls)
    assert found["tests.test_a.t"] == ["src.error.Error.new", "src.error.Error.msg"]  # not another crate's Error
    assert rust_crate_name('[package]\nname = "my-lib"\n') == "my_lib"
    assert rust_crate_name('[package]\nname = "my-lib"\n\n[lib]\nname = "mine"\n') == "mine"
    assert rust_crate_name('[workspace]\nmembers = ["a"]\n') is None
    assert rust_crate_name("not = [toml") is None
    # The ingester reads the Cargo.toml above the files.
    (tmp_path / "src").mkdir()
    (tmp_path / "Cargo.toml").write_text('[package]\nname = "my-lib"\nversion = "0.1.0"\n')
    assert rust_crates(tmp_path, files) == {"": "my_lib"}
    called = {c.symbol_fqn: c.calls for c in chunk_sources(tmp_path, files, 10**6) if c.calls}
    assert called["tests.test_a.t"] == ("src.error.Error.new", "src.error.Error.msg")


def test_a_retests_cases_types_across_modules_bindings_in_order_and_declared_locals() -> None:
    rust = _graph({
        "src/lib.rs": "mod e;\nuse crate::e::helper;\npub struct E;\npub fn top() { E::new(); helper() }\n",
        "src/e.rs": """
            use crate::E;

            impl E {
                pub fn new() -> E { E }
                fn make() -> E { E::new() }
            }

            pub fn user() -> E { E::new() }

            pub fn vt(p: u8) -> u8 { p }

            pub fn helper() { let vt = vt(1); fn inner() {} inner(); }

            fn inner() {}
            """,
    })  # fmt: skip
    found = _by_name(rust.calls)
    # An impl of a type another module declares (`use crate::E; impl E`): anyhow's Error::new() callers were 0.
    assert found["src.lib.top"] == ["src.e.E.new", "src.e.helper"]
    assert found["src.e.E.make"] == ["src.e.E.new"]
    assert found["src.e.user"] == ["src.e.E.new"]
    assert found["src.e.helper"] == ["src.e.vt"]  # bound after the call; the inner fn is not the file's
    links = {(link.source_type, link.name, link.target_type) for link in rust.links}
    assert ("src.e", IMPORTS, "src.lib") in links  # `use crate::E`: the root's file
    typescript = _by_name(_calls({
        "k.ts": """
            export class Ky { fetch() { return 1 } }
            export function parse() { return 1 }
            export function run(xs: string[], k: Ky) {
              const ky = new Ky(); ky.fetch(); k.fetch()
              for (const parse of xs) parse()
              const { p: parse2 } = { p: parse }; const [parse3] = [parse]
            }
            export function order() { parse(); const parse = () => 2; parse() }
            """,
    }))  # fmt: skip
    assert typescript["k.run"] == ["k.Ky", "k.Ky.fetch"]  # a local of `new Ky()` and a parameter `: Ky`
    assert typescript["k.order"] == ["k.parse"]  # the first, before the local is bound
    go = _by_name(_calls({
        "p/a.go": """
            package p

            type Server struct{}

            func (s *Server) Start() {}

            var shared = &Server{}

            func walk(x int) int { return x }

            func run() { var s = &Server{}; s.Start(); y := walk(1); walk := 3; _ = walk + y }
            """,
    }))  # fmt: skip
    assert go["p.a.run"] == ["p.a.Server.Start", "p.a.walk"]
    java = _by_name(_calls({
        "src/M.java": """
            import java.util.ArrayList;
            import java.util.List;

            class M {
              int size() { return 0; }
              B b;
              void each(List<C> xs) { xs.forEach(b -> b.go()); }
              static class Items extends ArrayList<String> { int count() { return size(); } }
            }

            class B { void go() {} }

            class C { void go() {} }
            """,
    }))  # fmt: skip
    assert "src.M.M.each" not in java  # the lambda's b, not the field's B
    assert "src.M.M.Items.count" not in java  # ArrayList's size(), not M's
    # A static import of the name itself beside a base outside the tree (a third run's javapoet: Comparable).
    statics = _by_name(_calls({
        "src/a/U.java": "package a;\n\nclass U {\n  static void check(boolean b) {}\n}\n",
        "src/a/A.java": "package a;\n\nimport static a.U.check;\n\n"
        "class A implements Comparable<A>, Cloneable {\n  void run() { check(true); }\n}\n",
    }))  # fmt: skip
    assert statics["src.a.A.A.run"] == ["src.a.U.U.check"]


def test_a_second_reviews_cases() -> None:
    # A path through another crate's module names none of this crate's types, nor does the prelude's Vec.
    rust = _graph({
        "c/src/lib.rs": "pub mod error;\nmod net;\nuse std::io;\n"
        "pub fn f() { io::Error::new(); std::io::Error::new(); Vec::new(); }\n",
        "c/src/error.rs": "pub struct Error;\nimpl Error { pub fn new() -> Self { Error } }\n"
        "pub struct Vec;\nimpl Vec { pub fn new() {} }\n",
        "c/src/net.rs": "use std::io;\nuse serde::Serialize;\n",
    })  # fmt: skip
    assert "c.src.lib.f" not in _by_name(rust.calls)
    assert not [link for link in rust.links if link.source_type == "c.src.net"]  # another crate's use: no link
    # Modules `pub use`-ing each other end, at once.
    cyclic = {f"src/m{n}.rs": f"pub use crate::m{(n + 1) % 6}::a as a;\n" for n in range(6)}
    cyclic["src/lib.rs"] = "".join(f"mod m{n};\n" for n in range(6)) + "fn g() { m0::a(); m3::a::b(); }\n"
    assert "src.lib.g" not in _by_name(_calls(cyclic))
    # Java: a resource, a pattern's name and `this.s` are what they are declared as, not a field's namesake.
    java = _by_name(_calls({
        "src/A.java": """
            class A {
              Server s;
              void r() { try (Client s = open()) { s.run(); } }
              void i(Object o) { if (o instanceof Client s) { s.run(); } }
              void t(Client s) { this.s.run(); }
              Client open() { return null; }
            }

            class Server { void run() {} }

            class Client implements AutoCloseable { void run() {} public void close() {} }
            """,
    }))  # fmt: skip
    assert java["src.A.A.r"] == ["src.A.A.open", "src.A.Client.run"]
    assert java["src.A.A.i"] == ["src.A.Client.run"]
    assert java["src.A.A.t"] == ["src.A.Server.run"]
    # TypeScript: a rest parameter binds its name; a base outside the tree is an interface by its name.
    typescript = _graph({
        "b.ts": "export function run() {}\nexport function f(...run: Array<() => void>) { run[0](); }\n"
        "export class View extends React.Component<P> implements Named {}\n",
    })  # fmt: skip
    assert "b.f" not in _by_name(typescript.calls)
    view = next(node for node in typescript.nodes if node.object_type == "b.View")
    assert view.interfaces == ("React.Component", "Named")
    # Rust: a name a pattern binds is not the module's function.
    patterns = _by_name(_calls({
        "src/lib.rs": "fn helper() {}\nfn f(x: Option<fn()>, xs: Vec<fn()>) {\n"
        "    if let Some(helper) = x { helper() }\n    for helper in xs { helper() }\n}\n",
    }))  # fmt: skip
    assert "src.lib.f" not in patterns


def test_re_exports_answer_alike_whichever_file_asks_first() -> None:
    files = {
        "u.ts": "export * from './v';\nexport * from './c';\n",
        "v.ts": "export * from './u';\n",
        "c.ts": "export function x() {}\n",
        "a.ts": "import { x } from './u';\nexport function a() { x() }\n",
        "b.ts": "import { x } from './v';\nexport function b() { x() }\n",
    }
    found = _by_name(_calls(files))
    backwards = _by_name(_calls(dict(reversed(list(files.items())))))
    assert found["a.a"] == found["b.b"] == backwards["a.a"] == backwards["b.b"] == ["c.x"]


def test_reading_ticks_for_each_file_and_stops_when_told(tmp_path: Path) -> None:
    files = {"a.ts": "export function a() {}\n", "b.go": "package b\n\nfunc B() {}\n", "c.py": "def c():\n    pass\n"}
    ticks: list[None] = []
    read_sources(tmp_path, files, None, 10**6, 0, lambda: ticks.append(None))
    assert 4 <= len(ticks) <= reading_steps(files)  # each of the two code files twice, at least

    def stop() -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        read_code(files, tick=stop)


def test_a_python_file_and_another_of_one_stem_make_pythons_node_alone(tmp_path: Path) -> None:
    files = {
        "pkg/__init__.py": "",
        "pkg/api.py": "class Foo:\n    pass\n",
        "pkg/api.ts": "export class Bar {}\nexport class Foo extends Bar {}\n",
    }
    _chunks, (nodes, links), defined_in = read_sources(tmp_path, files, None, 10**6, 0)
    foo = next(node for node in nodes if node.object_type == "pkg.api.Foo")
    assert foo.interfaces == ()  # Python's
    assert not [link for link in links if "pkg.api.Foo" in (link.source_type, link.target_type)]
    assert defined_in["pkg.api.Foo"] == "pkg/api.py"
    assert defined_in["pkg.api.Bar"] == "pkg/api.ts"  # the other's own nodes stay


def test_a_modules_code_and_its_declaration_file_make_one_node_answered_by_the_code() -> None:
    """An agent tester over a published npm package (each module an `x.js` and its types' `x.d.ts`): `implements`,
    written only in the declarations, was lost to the code's class read after it, and a module was answered by its
    `export {};` stub rather than the code importing what was asked."""
    read = _graph({
        "pkg/transport.d.ts": "export interface Transport { start(): Promise<void>; }\n",
        "pkg/transport.js": "export function helper() { return 1; }\n",
        "pkg/stdio.d.ts": "import { Transport } from './transport.js';\n"
        "export declare class Stdio implements Transport { start(): Promise<void>; }\n",
        "pkg/stdio.js": "import { helper } from './transport.js';\nimport { Base } from './base.js';\n"
        "export class Stdio extends Base { async start() { helper(); } }\n",
        "pkg/base.js": "export class Base {}\n",
        "pkg/example.d.ts": "export {};\n",
        "pkg/example.js": "import { Stdio } from './stdio.js';\nnew Stdio();\n",
    })  # fmt: skip
    nodes = {node.object_type: node for node in read.nodes}
    # Each file's bases, whichever is read first (the code's `extends` had replaced the declarations' `implements`).
    assert set(nodes["pkg.stdio.Stdio"].interfaces) == {"pkg.transport.Transport", "pkg.base.Base"}
    links = {(link.source_type, link.name, link.target_type) for link in read.links}
    assert {
        ("pkg.stdio.Stdio", INHERITS, "pkg.transport.Transport"),
        ("pkg.stdio.Stdio", INHERITS, "pkg.base.Base"),
    } <= links
    assert read.defined_in["pkg.stdio.Stdio"] == "pkg/stdio.js"
    assert read.defined_in["pkg.example"] == "pkg/example.js"
    assert read.defined_in["pkg.transport.Transport"] == "pkg/transport.d.ts"  # declared there alone
    links = {(link.source_type, link.name, link.target_type) for link in read.links}
    assert ("pkg.example", IMPORTS, "pkg.stdio") in links


def test_what_a_typescript_compiler_writes_for_commonjs_is_read() -> None:
    """The same agent tester over nats.js's compiled `lib/`: `(0, ns.f)()`, `extends ns.Base` and a method's body
    inside `__awaiter(this, ..., function* () {...})`, the forms tsc writes, were not read; nor `ns.Class.f()`."""
    files = {
        "lib/u.js": """
            "use strict";
            exports.Base = exports.helper = void 0;
            function helper() { return 1; }
            exports.helper = helper;
            class Base { run() { return 2; } static make() { return new Base(); } }
            exports.Base = Base;
            """,
        "lib/seq.js": """
            "use strict";
            const u_1 = require("./u");
            function viaSequence() { return (0, u_1.helper)(); }
            function viaClass() { return u_1.Base.make(); }
            class Derived extends u_1.Base {
                go() { return this.run(); }
                later() {
                    return __awaiter(this, void 0, void 0, function* () { yield (0, u_1.helper)(); this.go(); });
                }
            }
            exports.Derived = Derived;
            """,
    }
    calls = _by_name(_calls(files))
    assert calls["lib.seq.viaSequence"] == ["lib.u.helper"]
    assert calls["lib.seq.viaClass"] == ["lib.u.Base.make"]  # `ns.Class.f()`
    assert calls["lib.seq.Derived.go"] == ["lib.u.Base.run"]  # through the base written as `u_1.Base`
    assert calls["lib.seq.Derived.later"] == ["lib.u.helper", "lib.seq.Derived.go"]
    nodes = {node.object_type: node for node in _graph(files).nodes}
    assert nodes["lib.seq.Derived"].interfaces == ("lib.u.Base",)


def test_an_import_of_a_module_whose_declaration_file_is_not_read_goes_to_its_code() -> None:
    """A retest's nats.js: `require("../nats-base-client/mod")` resolved to `mod.d.ts`, generated with long lines
    and so indexed whole, not read; the import and the calls through it were lost though `mod.js` was read."""
    generated = "export declare const " + ", ".join(f"name{n}: number" for n in range(120)) + ";\n"
    read = _graph({
        "lib/mod.d.ts": generated * 3,
        "lib/mod.js": '"use strict";\nfunction helper() { return 1; }\nexports.helper = helper;\n',
        "lib/hub.js": '"use strict";\nconst mod_1 = require("./mod");\nfunction go() { return (0, mod_1.helper)(); }\n',
    })  # fmt: skip
    links = {(link.source_type, link.name, link.target_type) for link in read.links}
    assert ("lib.hub", IMPORTS, "lib.mod") in links
    assert _by_name(read.calls)["lib.hub.go"] == ["lib.mod.helper"]


def test_a_typescript_interfaces_extends_are_its_bases() -> None:
    """A retest's: `interface KV extends RoKV` had no base (only a class's heritage was read), nor 70 interfaces of
    the MCP SDK; a Java interface's were."""
    read = _graph({
        "lib/shapes.ts": "export interface Shape { area(): number }\n"
        "export interface Square extends Shape { side: number }\n"
        "export interface Box extends Square, Iterable<number> { depth: number }\n",
    })  # fmt: skip
    nodes = {node.object_type: node for node in read.nodes}
    assert nodes["lib.shapes.Square"].interfaces == ("lib.shapes.Shape",)
    assert nodes["lib.shapes.Box"].interfaces == ("lib.shapes.Square", "Iterable")  # an outside one by its name
    links = {(link.source_type, link.name, link.target_type) for link in read.links}
    assert {
        ("lib.shapes.Square", INHERITS, "lib.shapes.Shape"),
        ("lib.shapes.Box", INHERITS, "lib.shapes.Square"),
    } <= links


def test_a_name_is_looked_up_through_a_files_re_exports_before_its_declaration_file() -> None:
    """A review's: `index.d.ts` declaring `Foo` took the place of the `impl.js` that `index.js` re-exports it from;
    and a function given `this` by another call than tslib's `__awaiter` keeps its own `this`."""
    calls = _by_name(_calls({
        "p/impl.js": "export class Foo { go() { return 1; } }\n",
        "p/index.js": "export * from './impl.js';\n",
        "p/index.d.ts": "export declare class Foo { go(): number; }\n",
        "p/user.js": "import { Foo } from './index.js';\nexport function use() { return new Foo(); }\n"
        "export class A {\n  go() { return 1; }\n"
        "  later() { return $.proxy(this, function () { return this.go(); }); }\n}\n",
    }))  # fmt: skip
    assert calls["p.user.use"] == ["p.impl.Foo"]
    assert "p.user.A.later" not in calls


def test_a_decomposed_file_name_is_named_and_imported_as_composed() -> None:
    """A Unicode tester's ``módulo.ts``, its name decomposed (as macOS writes names), was found by neither spelling,
    and an import spelling it composed resolved to nothing."""
    read = read_code({
        "tsmod/mo\u0301dulo.ts": "export class Basis {}\nexport function hilfe(): void {}\n",
        "tsmod/nutzer.ts": "import { Basis, hilfe } from './m\u00f3dulo';\nexport class Kind extends Basis {}\n"
        "export function rufe(): void { hilfe(); }\n",
    })  # fmt: skip
    inherits = {(link.source_type, link.target_type) for link in read.links if link.name == INHERITS}
    assert inherits == {("tsmod.nutzer.Kind", "tsmod.m\u00f3dulo.Basis")}
    assert _by_name(read.calls)["tsmod.nutzer.rufe"] == ["tsmod.m\u00f3dulo.hilfe"]
    names = {c.symbol_fqn for c in chunk_code("tsmod/mo\u0301dulo.ts", "export class Basis {}\n", 10**6)}
    assert names == {"tsmod.m\u00f3dulo", "tsmod.m\u00f3dulo.Basis"}
