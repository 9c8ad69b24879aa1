"""TLS to NATS (mutual TLS too) and to PostgreSQL, with a CA and certificates made for the test."""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import ipaddress
import ssl
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import asyncpg
import nats
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from ontofabric.shared.db import create_pool, migrate
from ontofabric.shared.jetstream import connect, nats_tls
from ontofabric.shared.nats_auth import NatsUser
from ontofabric.shared.runtime import (
    free_port,
    start_postgres,
)
from ontofabric.shared.settings import Settings

from .conftest import pump, spawn_nats

pytestmark = pytest.mark.slow  # starts servers of its own


@dataclass(frozen=True)
class Pki:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    other_ca: Path
    """A CA that signed nothing here: trusting it alone must fail."""


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _name(common: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common)])


def _write(path: Path, cert: x509.Certificate, key: ec.EllipticCurvePrivateKey | None = None) -> None:
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    if key is not None:
        key_path = path.with_suffix(".key")
        key_path.write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            )
        )
        key_path.chmod(0o600)


def _ca(directory: Path, common: str) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey, Path]:
    key = _key()
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(common))
        .issuer_name(_name(common))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(True, False, False, False, False, True, True, False, False), critical=True
        )  # digital signature, certificate and CRL signing
        .sign(key, hashes.SHA256())
    )
    path = directory / f"{common}.pem"
    _write(path, cert)
    return cert, key, path


def _leaf(
    directory: Path, common: str, ca: x509.Certificate, ca_key: ec.EllipticCurvePrivateKey, *, server: bool
) -> Path:
    key = _key()
    now = datetime.datetime.now(datetime.UTC)
    usage = x509.ExtendedKeyUsageOID.SERVER_AUTH if server else x509.ExtendedKeyUsageOID.CLIENT_AUTH
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(common))
        .issuer_name(ca.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
    )
    if server:
        names = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
        builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
    path = directory / f"{common}.pem"
    _write(path, builder.sign(ca_key, hashes.SHA256()), key)
    return path


@pytest.fixture
def pki(tmp_path: Path) -> Pki:
    ca, ca_key, ca_path = _ca(tmp_path, "test-ca")
    _, _, other = _ca(tmp_path, "other-ca")
    server = _leaf(tmp_path, "server", ca, ca_key, server=True)
    client = _leaf(tmp_path, "client", ca, ca_key, server=False)
    return Pki(ca_path, server, server.with_suffix(".key"), client, client.with_suffix(".key"), other)


@pytest.fixture
def tls_nats(tmp_path: Path, pki: Pki) -> Iterator[str]:
    """A nats-server that requires TLS and a client certificate its CA signed (mutual TLS), and a password."""
    port = free_port()
    tls = {
        "cert_file": str(pki.server_cert),
        "key_file": str(pki.server_key),
        "ca_file": str(pki.ca),
        "verify": True,
        "handshake_first": True,
    }
    users = {"op": NatsUser("op", "secret-pw", "operator", "ontofabric")}
    server = spawn_nats(tmp_path, port, users, {"tls": tls})
    try:
        yield f"nats://op:secret-pw@127.0.0.1:{port}"
    finally:
        server.stop()


async def test_nats_over_mutual_tls(tls_nats: str, pki: Pki) -> None:
    mutual = Settings(nats_tls_ca=pki.ca, nats_tls_cert=pki.client_cert, nats_tls_key=pki.client_key)
    nc = await connect(tls_nats, "tls-test", mutual)
    try:
        reply = await nc.request("$JS.API.INFO", b"", timeout=5)
        assert b"memory" in reply.data  # a JetStream API answer: the operator is in
    finally:
        await nc.close()
    # Without a client certificate the server refuses the handshake; trusting another CA, the client refuses the
    # server; in plain text, the server refuses the connection.
    refusals = [
        Settings(nats_tls_ca=pki.ca),
        Settings(nats_tls_ca=pki.other_ca, nats_tls_cert=pki.client_cert, nats_tls_key=pki.client_key),
        Settings(),
    ]
    for settings in refusals:
        with pytest.raises((nats.errors.Error, ssl.SSLError, OSError)):  # noqa: PT012
            tls = nats_tls(settings)
            refused = await nats.connect(
                tls_nats, allow_reconnect=False, connect_timeout=5, tls=tls, tls_handshake_first=tls is not None
            )
            await refused.close()


async def test_with_a_ca_set_credentials_never_reach_a_server_in_plain_text(tmp_path: Path, pki: Pki) -> None:
    """A server (or a man in the middle) that does not ask for TLS must not get the password: the client does the
    TLS handshake first, so it fails before anything is sent."""
    received = bytearray()

    async def plain_server(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b'INFO {"server_id":"x","version":"2.15.1","auth_required":true,"max_payload":1048576}\r\n')
        await writer.drain()
        with contextlib.suppress(ConnectionError):
            received.extend(await reader.read(65536))
        writer.close()

    server = await asyncio.start_server(plain_server, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:

        async def attempt() -> None:
            nc = await connect(f"nats://op:secret-pw@127.0.0.1:{port}", "downgrade", Settings(nats_tls_ca=pki.ca))
            await nc.close()

        with pytest.raises((nats.errors.Error, ssl.SSLError, OSError, asyncio.TimeoutError)):
            await asyncio.wait_for(attempt(), 3)
    finally:
        server.close()
    assert b"secret-pw" not in received


@contextlib.asynccontextmanager
async def _tls_in_front_of(port: int, pki: Pki) -> AsyncIterator[int]:
    """A TLS endpoint speaking PostgreSQL's SSLRequest handshake in front of a plain server on ``port``: the
    embedded PostgreSQL is built without TLS, so this stands in for one that has it (it presents the server
    certificate, and passes the bytes on once the client is satisfied)."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(str(pki.server_cert), str(pki.server_key))

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        request = await reader.readexactly(8)
        assert int.from_bytes(request[4:], "big") == 80877103  # SSLRequest
        writer.write(b"S")
        await writer.drain()
        try:
            await writer.start_tls(context)
        except (ssl.SSLError, ConnectionError):  # the client refused the certificate
            writer.close()
            return
        upstream_reader, upstream_writer = await asyncio.open_connection("127.0.0.1", port)
        await asyncio.gather(pump(reader, upstream_writer), pump(upstream_reader, writer))

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    try:
        yield server.sockets[0].getsockname()[1]
    finally:
        server.close()


async def test_postgres_over_verified_tls(tmp_path: Path, pki: Pki) -> None:
    server, url = start_postgres(tmp_path / "postgres")
    plain = urlsplit(url)
    try:
        assert plain.port is not None
        async with _tls_in_front_of(plain.port, pki) as tls_port:
            # What a deployment sets: the CA in the URL, the server's certificate and name verified.
            login = plain.netloc.rpartition("@")[0]
            tls_url = f"postgresql://{login}@127.0.0.1:{tls_port}{plain.path}"
            settings = Settings(database_url=f"{tls_url}?sslmode=verify-full&sslrootcert={pki.ca}")
            assert settings.database_url is not None
            applied = await migrate(settings.database_url, settings)
            assert applied  # the whole schema, through TLS
            pool = await create_pool(settings.database_url, settings, min_size=1, max_size=1)
            try:
                assert await pool.fetchval("SELECT count(*) FROM schema_migrations") == len(applied)
            finally:
                await pool.close()
            # A server whose certificate another CA signed is refused; so is a server without TLS when TLS is
            # required: the connection is never silently plain.
            with pytest.raises(ssl.SSLCertVerificationError):
                await asyncpg.connect(f"{tls_url}?sslmode=verify-full&sslrootcert={pki.other_ca}")
            with pytest.raises(ConnectionError, match=r"(?i)ssl"):
                await asyncpg.connect(f"{url}?sslmode=require")
    finally:
        server.stop()
