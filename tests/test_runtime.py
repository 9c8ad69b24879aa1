"""The embedded runtime's choices that need no servers: configured URLs start nothing, clients get clear errors."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from ontofabric.shared.runtime import RUNTIME_FILE, EmbeddedRuntime, RuntimeUnavailable, resolve_endpoints
from ontofabric.shared.settings import Settings


def test_configured_urls_start_nothing(tmp_path: Path) -> None:
    settings = Settings(nats_url="nats://nats.example:4222", database_url="postgresql://db.example/x")
    with EmbeddedRuntime(settings, tmp_path) as runtime:
        assert runtime.endpoints is not None
        assert runtime.endpoints.nats_url == "nats://nats.example:4222"
        assert not (tmp_path / RUNTIME_FILE).exists()
        assert not (tmp_path / "nats").exists()
        assert not (tmp_path / "postgres").exists()


def test_clients_find_a_running_up_or_say_what_to_do(tmp_path: Path) -> None:
    settings = Settings(data_dir=tmp_path)
    with pytest.raises(RuntimeUnavailable, match="ontofabric up"):
        resolve_endpoints(settings)
    (tmp_path / RUNTIME_FILE).write_text(
        json.dumps({"natsUrl": "nats://127.0.0.1:1", "databaseUrl": "postgresql://x/y", "pid": os.getpid()})
    )
    assert resolve_endpoints(settings).nats_url == "nats://127.0.0.1:1"
    # A file left by a process that is gone does not count.
    (tmp_path / RUNTIME_FILE).write_text(
        json.dumps({"natsUrl": "nats://127.0.0.1:1", "databaseUrl": "postgresql://x/y", "pid": 2**22 + 12345})
    )
    with pytest.raises(RuntimeUnavailable):
        resolve_endpoints(settings)


def test_a_second_runtime_on_the_same_directory_is_refused(tmp_path: Path) -> None:
    first = EmbeddedRuntime(Settings(database_url="postgresql://db.example/x"), tmp_path)
    first._take_lock()
    try:
        with pytest.raises(RuntimeUnavailable, match="another ontofabric process"):
            EmbeddedRuntime(Settings(database_url="postgresql://db.example/x"), tmp_path)._take_lock()
    finally:
        first.stop()
