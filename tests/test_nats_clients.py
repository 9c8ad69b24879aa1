"""A NATS client not written in Python asks a query worker the way README's "Your own NATS client" says: nats.js
with the `client` user, its inbox prefix and the timeout header. The worker is the real one, on a real nats-server
whose permissions confine the client to its own inbox."""

from __future__ import annotations

import asyncio
import json
import subprocess
from urllib.parse import unquote, urlsplit

from ontofabric.shared.embedder import Embedder

from .conftest import Deployment, Start, node_script


async def test_nats_js_asks_as_the_readme_says(
    seeded: int, deployment: Deployment, start_query_worker: Start, embedder: Embedder
) -> None:
    await start_query_worker(embedder)
    script = node_script("nats_client.mjs", "nats")
    url = urlsplit(deployment.nats_url_as("client"))
    user, password = unquote(url.username or ""), unquote(url.password or "")
    assert user.endswith("~client")  # the client role's own user, not the operator's
    server = f"{url.hostname}:{url.port}"
    subject = deployment.names.request_subject("query", "acme")
    body = json.dumps({"semanticQuery": "how do I sort a list of numbers in descending order", "topK": 3})
    completed = await asyncio.to_thread(
        subprocess.run, ["node", str(script), server, user, password, subject, body],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert completed.returncode == 0, completed.stderr
    seen = json.loads(completed.stdout)
    for answer in (seen["stated"], seen["unstated"]):
        assert answer["results"][0]["id"] == "sort", answer
        assert answer["_meta"]["hybrid"] is True
    error = seen["malformed"]["error"]
    assert (error["code"], error["retryable"]) == ("invalid_request", False)
    assert {detail["field"] for detail in error["details"]} >= {"semanticQuery", "topK"}
    # Without the inbox prefix the reply subscription is refused: no answer reaches that client.
    assert seen["withoutInboxPrefix"] == {"clientError": "PERMISSIONS_VIOLATION"}
