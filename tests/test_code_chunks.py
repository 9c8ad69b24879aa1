"""Code other than Python cut into its declarations (services/ingest/code.py): a monorepo tester's Go, TypeScript,
Rust and Java files were not read at all."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from ontofabric.services.ingest.chunking import chunk_file
from ontofabric.services.ingest.code import MINIFIED_LINE_CHARS
from ontofabric.services.ingest.ingester import read_tree

TYPESCRIPT = """\
import {x} from "./a";
/** Fetches the current user. */
export function useCurrentUser(id: string) {
  return fetch(id);
}
// A fetch wrapper.
export const apiFetch = async (u: string) => { return 1 };
const LIMIT = 3;
export default class Store extends Base implements I {
  private x = 1;
  /** Loads it. */
  load(id: number): void { this.x = id; }
}
interface User { id: string }
namespace Api { export function ping() {} }
"""

GO = """\
package auth

// RequireJWT checks the bearer token.
func RequireJWT(next http.Handler) http.Handler {
\treturn next
}

type Server struct{ port int }

// Start listens.
func (s *Server) Start() error { return nil }
"""

RUST = """\
/// A token bucket.
pub struct TokenBucket { n: u32 }

impl<T> TokenBucket {
    /// Takes one token.
    pub fn take(&mut self) -> bool { true }
}

pub trait Limiter { fn allow(&self) -> bool; }

mod net { pub fn dial() {} }
"""

JAVA = """\
package com.acme;

/** Computes taxes. */
public class TaxCalculator {
  public TaxCalculator(double rate) {}
  /** Value-added tax. */
  public double vat(double x) { return x; }
}
"""


def _seen(path: str, source: str) -> list[tuple[str, str, str, str, tuple[int, int] | None]]:
    return [
        (c.symbol_kind, c.chunk_level, c.symbol_fqn, c.object_type, c.lines) for c in chunk_file(path, source, 65536)
    ]


def test_typescript_declarations_are_chunks_with_their_comments_and_lines() -> None:
    assert _seen("web/src/hooks.ts", TYPESCRIPT) == [
        ("module", "file", "web.src.hooks", "web.src.hooks", (1, 15)),
        ("function", "method", "web.src.hooks.useCurrentUser", "web.src.hooks", (2, 5)),  # its JSDoc with it
        ("function", "method", "web.src.hooks.apiFetch", "web.src.hooks", (6, 7)),  # a function held by a const
        ("class", "type", "web.src.hooks.Store", "web.src.hooks.Store", (9, 13)),  # LIMIT, no function: none
        ("method", "method", "web.src.hooks.Store.load", "web.src.hooks.Store", (11, 12)),
        ("interface", "type", "web.src.hooks.User", "web.src.hooks.User", (14, 14)),
        ("function", "method", "web.src.hooks.Api.ping", "web.src.hooks.Api", (15, 15)),  # a namespace's
    ]
    (useful,) = [c for c in chunk_file("web/src/hooks.ts", TYPESCRIPT, 65536) if c.symbol_fqn.endswith("apiFetch")]
    assert (useful.source_domain, useful.content) == (
        "typescript",
        "// A fetch wrapper.\nexport const apiFetch = async (u: string) => { return 1 };\n",
    )
    assert useful.symbol_key == "typescript:web/src/hooks.ts/apiFetch()."


def test_go_rust_and_java_declarations_are_chunks_named_by_their_owners() -> None:
    assert _seen("api/auth/mw.go", GO)[1:] == [
        ("function", "method", "api.auth.mw.RequireJWT", "api.auth.mw", (3, 6)),
        ("struct", "type", "api.auth.mw.Server", "api.auth.mw.Server", (8, 8)),
        ("method", "method", "api.auth.mw.Server.Start", "api.auth.mw.Server", (10, 11)),  # by its receiver
    ]
    assert _seen("rl/lib.rs", RUST)[1:] == [
        ("struct", "type", "rl.lib.TokenBucket", "rl.lib.TokenBucket", (1, 2)),
        ("method", "method", "rl.lib.TokenBucket.take", "rl.lib.TokenBucket", (5, 6)),  # of the type `impl` names
        ("trait", "type", "rl.lib.Limiter", "rl.lib.Limiter", (9, 9)),
        ("method", "method", "rl.lib.Limiter.allow", "rl.lib.Limiter", (9, 9)),
        ("function", "method", "rl.lib.net.dial", "rl.lib.net", (11, 11)),  # a module's, as in Python
    ]
    assert _seen("src/TaxCalculator.java", JAVA)[1:] == [
        ("class", "type", "src.TaxCalculator.TaxCalculator", "src.TaxCalculator.TaxCalculator", (3, 8)),
        (
            "method",
            "method",
            "src.TaxCalculator.TaxCalculator.constructor",
            "src.TaxCalculator.TaxCalculator",
            (5, 5),
        ),
        ("method", "method", "src.TaxCalculator.TaxCalculator.vat", "src.TaxCalculator.TaxCalculator", (6, 7)),
    ]


@pytest.mark.parametrize("path", ["dist/app.min.js", "web/bundle.js"])
def test_a_minified_file_is_its_files_chunk_alone(path: str) -> None:
    source = "function a(){return 1};" * (MINIFIED_LINE_CHARS // 10) + "\n"
    (only,) = chunk_file(path, source * 3, 65536)
    assert only.chunk_level == "file"
    assert "minified" in (only.parse_error or "")


def test_code_that_does_not_parse_keeps_what_the_parser_recovers_and_the_file() -> None:
    broken = "export function ok() { return 1 }\nfunction broken( {\n"
    chunks = chunk_file("a.ts", broken, 65536)
    assert chunks[0].chunk_level == "file"
    assert "a.ok" in [c.symbol_fqn for c in chunks]


def test_configuration_and_scripts_are_read_whole_and_lockfiles_are_not_sources(tmp_path: Path) -> None:
    (chunk,) = chunk_file("deploy/k8s.yaml", "apiVersion: apps/v1\nkind: Deployment\n---\nreplicas: 3\n", 65536)
    assert (chunk.source_domain, chunk.lines, chunk.content.count("\n")) == ("yaml", (1, 4), 4)
    for name in ("k8s.yaml", "pnpm-lock.yaml", "main.go", "schema.sql", "Dockerfile"):
        (tmp_path / name).write_text("x\n")
    kinds: Counter[str] = Counter()
    assert sorted(read_tree(tmp_path, other_kinds=kinds)) == ["k8s.yaml", "main.go", "schema.sql"]
    assert kinds == {"pnpm-lock.yaml": 1, "Dockerfile": 1}


def test_declarations_nested_past_the_recursion_limit_stop_at_a_depth_not_the_ingest() -> None:
    """Generated code nests deeper than Python recurses: its declarations there are left to its file's chunk."""
    source = "".join(f"namespace N{n} {{\n" for n in range(3000)) + "export function deep() {}\n" + "}\n" * 3000
    (only,) = chunk_file("deep.ts", source, 1 << 20)
    assert only.chunk_level == "file"
    nested = "".join(f"class C{n} {{\n" for n in range(2000)) + "}\n" * 2000
    assert len(chunk_file("Deep.java", nested, 1 << 20)) > 10


def test_attributes_decorators_and_overloads_go_with_their_declaration_and_its_doc() -> None:
    """An agent tester's: `#[...]` and `@Decorator` cut a doc comment off its declaration (anyhow's `Error` was its
    struct's three lines); a TypeScript overload's signatures and doc were left out of the implementation's chunk;
    `.d.ts` declarations, class fields holding functions, constants and macros were not found by name; a Java
    constructor, named as its class, was found for the class."""
    rust = "/// A bucket.\n#[derive(Debug)]\n#[repr(C)]\npub struct Bucket;\npub const LIMIT: u8 = 3;\n"
    rust += "/// Stops.\nmacro_rules! bail { () => {} }\n"
    chunks = chunk_file("b.rs", rust, 65536)
    assert [(c.symbol_fqn, c.lines) for c in chunks[1:]] == [("b.Bucket", (1, 4)), ("b.bail", (6, 7))]
    assert chunks[0].defines == ("LIMIT",)
    typescript = """\
/** A component. */
@Component({})
export class Comp {
  /** Lists them. */
  @Get("/items")
  list() {}
  handleClick = () => {};
  label = "x";
  /** Two ways. */
  f(a: string): void;
  f(a: number): void;
  f(a: any) {}
}
export const LIMIT = 3, helper = () => 1;
"""
    assert [(c.symbol_fqn, c.lines) for c in chunk_file("c.ts", typescript, 65536)[1:]] == [
        ("c.Comp", (1, 13)),
        ("c.Comp.list", (4, 6)),
        ("c.Comp.handleClick", (7, 7)),
        ("c.Comp.f", (9, 12)),  # its overloads and their doc with it, once
        ("c.helper", (14, 14)),
    ]
    assert chunk_file("c.ts", typescript, 65536)[0].defines == ("LIMIT",)
    ambient = "export declare class Client { connect(): void; }\nexport declare function open(url: string): Client;\n"
    assert [c.symbol_fqn for c in chunk_file("sdk/index.d.ts", ambient, 65536)] == [
        "sdk.index", "sdk.index.Client", "sdk.index.Client.connect", "sdk.index.open",
    ]  # fmt: skip
    go = "package x\n\nconst A, B = 1, 2\n\nvar (\n\tC = 3\n)\n"
    assert chunk_file("x.go", go, 65536)[0].defines == ("A", "B", "C")


def test_java_and_go_declarations_are_named_by_their_package_too_and_a_syntax_error_is_said() -> None:
    """A polyglot tester's `server.Handle` found Go's method `Server.Handle`, and `com.squareup.javapoet.TypeSpec`
    nothing; an unclosed Java method took the next one into it without a word."""
    java = "package com.acme;\n\nclass Tax {\n  double vat() { return 1 }\n  void b() {}\n}\n"
    with capture_logs() as logs:
        chunks = chunk_file("src/Tax.java", java, 65536)
    assert [(c.symbol_fqn, c.aliases) for c in chunks[1:2]] == [("src.Tax.Tax", ("com.acme.Tax",))]
    assert [(e["event"], e["line"]) for e in logs] == [("ingest_code_not_parsed_whole", 4)]
    go = "package server\n\nfunc Handle() {}\n"
    assert chunk_file("srv/other.go", go, 65536)[1].aliases == ("server.Handle",)
    assert chunk_file("web/a.ts", "export function f() {}\n", 65536)[1].aliases == ()  # no package declared


def test_overloads_go_once_with_the_last_and_go_types_keep_their_doc() -> None:
    """A polyglot retest's: exported overloads were three chunks at 1.0 each, a `.d.ts` method's four signatures
    four chunks each holding those above it; 19 of gorilla/mux's 32 types started below their doc comment; a
    `.d.ts` of a few long lines was taken for minified; `export declare const` named nothing; `impl Display for
    (A, B)` was named `A.fmt`."""
    typescript = """\
/** Formats. */
export function formatAmount(a: number): string;
export function formatAmount(a: string): string;
export function formatAmount(a: any): string { return String(a); }
export declare const VERSION: string;
declare class Req {
  param(key: string): string;
  param(): Record<string, string>;
  other(): void;
}
"""
    chunks = chunk_file("sdk/a.d.ts", typescript, 65536)
    assert [(c.symbol_fqn, c.lines) for c in chunks[1:]] == [
        ("sdk.a.formatAmount", (1, 4)),
        ("sdk.a.Req", (6, 10)),
        ("sdk.a.Req.param", (7, 8)),
        ("sdk.a.Req.other", (9, 9)),
    ]
    assert chunks[0].defines == ("VERSION",)
    go = "package mux\n\n// Router registers routes.\ntype Router struct {\n\tx int\n}\n"
    assert [(c.symbol_fqn, c.lines) for c in chunk_file("r.go", go, 65536)[1:]] == [("r.Router", (3, 6))]
    long = "export type T = {" + "a: string; " * 220 + "};\n"
    declared = long * 3 + "".join(f"export function f{n}() {{}}\n" for n in range(20))
    assert len(chunk_file("types.d.ts", declared, 1 << 20)) == 24  # the file, T three times, 20 functions
    assert [c.symbol_fqn for c in chunk_file("t.rs", "impl Display for (A, B) { fn fmt(&self) {} }\n", 65536)] == [
        "t",
        "t.impl.fmt",
    ]


def test_a_types_fields_are_named_by_its_chunk() -> None:
    """A polyglot retest's Java `STANDARD_RATE` answered with a constructor: a type's fields that hold no function
    are named by its chunk, as a Python class's attributes are."""
    java = "class A { public static final double STANDARD_RATE = 0.2, LOW = 0.1; private int x; void f() {} }\n"
    assert [c.defines for c in chunk_file("A.java", java, 65536)] == [(), ("STANDARD_RATE", "LOW", "x"), ()]
    typescript = 'class C { label = "x"; static count: number; handle = () => 1; m() {} }\n'
    assert [c.defines for c in chunk_file("c.ts", typescript, 65536)] == [(), ("label", "count"), (), ()]


def test_a_bundle_under_a_short_line_is_one_chunk_and_a_function_beside_its_namespace_is_read() -> None:
    """A review's: a bundle of 10,000 functions on one line under a source map's comment was 10,000 chunks, each
    the whole line (the lower median was the short line); `declare function debug` beside `declare namespace
    debug` was taken for an overload of it and lost; a Rust `//!` above the first item was taken for its doc."""
    bundle = "".join(f"function f{n}(){{return {n}}}" for n in range(2000)) + "\n//# sourceMappingURL=app.js.map\n"
    (only,) = chunk_file("app.js", bundle, 1 << 20)
    assert "minified" in (only.parse_error or "")
    banner = "/* a banner */\n/* of three */\n/* lines */\n" + bundle
    assert len(chunk_file("app.js", banner, 1 << 20)) == 1  # not flagged: its declarations share the long line
    typings = "declare function debug(name: string): Debugger;\ndeclare namespace debug { function enable(): void; }\n"
    assert [c.symbol_fqn for c in chunk_file("debug.d.ts", typings, 65536)] == [
        "debug",
        "debug.debug",
        "debug.debug.enable",
    ]
    rust = "//! The crate.\npub fn first() {}\n"
    assert chunk_file("lib.rs", rust, 65536)[1].lines == (2, 2)


def test_a_chunk_of_another_language_takes_no_name_pythons_exports_give() -> None:
    """A review's: `app/models.ts` and `app/models.py` are both `app.models`, and the TypeScript `User` took the
    alias `app.User` that `app/__init__.py` gives the Python one."""
    from ontofabric.services.ingest.ingester import chunk_sources

    sources = {
        "app/__init__.py": "from .models import User\n",
        "app/models.py": "class User: ...\n",
        "app/models.ts": "export class User {}\n",
    }
    chunks = {(c.file_path, c.symbol_fqn): c for c in chunk_sources(Path("."), sources, 1 << 20)}
    assert chunks[("app/models.py", "app.models.User")].aliases == ("app.User",)
    assert chunks[("app/models.ts", "app.models.User")].aliases == ()


def test_a_files_own_comment_above_the_first_declarations_doc_comment_is_not_the_declarations() -> None:
    """An agent tester's `.d.ts`, compiled without blank lines: its first function's chunk began at line 1, the file's
    own doc comment. The doc comment right above a declaration is its own, and no comment above that."""
    source = (
        "/**\n * Tool name validation.\n */\n"
        "/**\n * Validates a name.\n */\n"
        "export declare function validateToolName(name: string): boolean;\n"
        "// eslint-disable-next-line\n// the second, too\n"
        "/** Warns. */\n"
        "export declare function warn(name: string): void;\n"
    )
    spans = {fqn: lines for _kind, _level, fqn, _type, lines in _seen("shared/names.d.ts", source)}
    assert spans["shared.names.validateToolName"] == (4, 7)
    assert spans["shared.names.warn"] == (10, 11)
    # A review's: each overload's doc comment, and a tool's comment below the doc, are still the declaration's.
    overloads = (
        "/** Parses text. */\nexport declare function parse(a: string): number;\n"
        "/** Parses a number. */\nexport declare function parse(a: number): number;\n"
    )
    assert [lines for *_, lines in _seen("p.d.ts", overloads)][1:] == [(1, 4)]
    tooled = "/* Copyright */\n/** Adds. */\n/* istanbul ignore next */\nexport function add(a: number) { return a }\n"
    assert [lines for *_, lines in _seen("p.ts", tooled)][1:] == [(2, 4)]
