"""The reference ingester through the real path: incremental publishes, deletes, and the projected rows."""

from __future__ import annotations

import textwrap
from pathlib import Path

from ontofabric.services.ingest.chunking import chunk_file
from ontofabric.services.ingest.ingester import Ingester
from ontofabric.services.projector.worker import ProjectorService
from ontofabric.shared.embedder import Embedder

from .conftest import Deployment


def _write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))


async def _live(deployment: Deployment) -> dict[str, tuple[str, str]]:
    rows = await deployment.fetch(
        "SELECT symbol_key, content_hash, chunk_level FROM documents WHERE workspace = 'repo' AND NOT deleted"
    )
    return {r["symbol_key"]: (r["content_hash"], r["chunk_level"]) for r in rows}


async def test_ingest_publishes_only_what_changed(
    deployment: Deployment, projector: ProjectorService, embedder: Embedder, tmp_path: Path
) -> None:
    _write(
        tmp_path,
        {
            "pkg/__init__.py": '"""The package."""\n',
            "pkg/shapes.py": """
                class Circle:
                    def area(self, r):
                        return 3.14 * r * r
                """,
            "README.md": "# Shapes\nCompute areas.\n## Usage\nCall area.\n",
            ".hidden/skip.py": "x = 1\n",
            "notes.txt": "not a source file\n",
        },
    )
    ingester = Ingester(deployment.js, deployment.names, embedder, deployment.settings.max_content_bytes)

    first = await ingester.ingest(tmp_path, "repo")
    assert first.files == 3
    assert first.upserts == first.chunks == 7  # __init__ file+doc, shapes file+class+method, two sections
    assert first.deletes == 0
    assert first.last_sequence is not None
    await deployment.wait_projected(first.last_sequence)
    live = await _live(deployment)
    assert len(live) == 7
    assert live["python:pkg/shapes.py/Circle.area()."][1] == "method"
    embedded = await deployment.fetch("SELECT count(*) AS n FROM documents WHERE embedding IS NOT NULL")
    assert embedded[0]["n"] == 7

    unchanged = await ingester.ingest(tmp_path, "repo")
    assert (unchanged.upserts, unchanged.deletes, unchanged.unchanged) == (0, 0, 7)
    assert unchanged.last_sequence is None

    # Edit one method, remove the package docstring file, add nothing else.
    (tmp_path / "pkg/shapes.py").write_text("class Circle:\n    def area(self, r):\n        return 3.14159 * r * r\n")
    (tmp_path / "pkg/__init__.py").unlink()
    changed = await ingester.ingest(tmp_path, "repo")
    # The file, the class and the method chunks of shapes.py changed; the package's two chunks vanished.
    assert (changed.upserts, changed.deletes) == (3, 2)
    assert changed.last_sequence is not None
    await deployment.wait_projected(changed.last_sequence)
    live = await _live(deployment)
    expected = {
        c.symbol_key: (c.content_hash, c.chunk_level)
        for name in ("pkg/shapes.py", "README.md")
        for c in chunk_file(name, (tmp_path / name).read_text(), deployment.settings.max_content_bytes)
    }
    assert live == expected


async def test_branches_have_their_own_manifest(
    deployment: Deployment, projector: ProjectorService, tmp_path: Path
) -> None:
    _write(tmp_path, {"a.py": "def f():\n    return 1\n"})
    ingester = Ingester(deployment.js, deployment.names, None, deployment.settings.max_content_bytes)
    main = await ingester.ingest(tmp_path, "repo")
    branch = await ingester.ingest(tmp_path, "repo", "feature/x")
    assert main.upserts == branch.upserts == 2
    assert branch.last_sequence is not None
    await deployment.wait_projected(branch.last_sequence)
    rows = await deployment.fetch("SELECT branch, count(*) AS n FROM documents GROUP BY branch ORDER BY branch")
    assert [(r["branch"], r["n"]) for r in rows] == [("feature/x", 2), ("main", 2)]
