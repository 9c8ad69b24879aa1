"""ruff and mypy are part of the test suite, so CI keeps the tree lint- and type-clean."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
# The import package is `ontofabric.*` mapped onto the top-level folders; mypy reads it through a link tree.
PACKAGE_DIRS = {"contracts": "contracts", "shared": "shared", "services": "services", "migrations": "infra/migrations"}


def _run(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, env=env, check=False)


def test_ruff_lint() -> None:
    result = _run(str(BIN / "ruff"), "check", ".")
    assert result.returncode == 0, result.stdout + result.stderr


def test_ruff_format() -> None:
    result = _run(str(BIN / "ruff"), "format", "--check", ".")
    assert result.returncode == 0, result.stdout + result.stderr


def test_mypy_strict(tmp_path: Path) -> None:
    package = tmp_path / "ontofabric"
    package.mkdir()
    for name, folder in PACKAGE_DIRS.items():
        (package / name).symlink_to(ROOT / folder)
    env = {**os.environ, "MYPYPATH": str(tmp_path)}
    result = _run(str(BIN / "mypy"), "--cache-dir", str(ROOT / ".mypy_cache"), "-p", "ontofabric", env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    # The benchmark scripts run by hand only: type-checking them is what keeps them in step with the code.
    scripts = sorted(str(path) for path in (ROOT / "tests" / "benchmarks").glob("*.py"))
    result = _run(str(BIN / "mypy"), "--cache-dir", str(ROOT / ".mypy_cache"), *scripts, env=env)
    assert result.returncode == 0, result.stdout + result.stderr
