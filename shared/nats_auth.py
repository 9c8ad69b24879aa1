"""NATS roles: what each part may publish and subscribe to, as nats-server permissions (docs/security.md).

Every role is a user of the server. A user may subscribe under ``_INBOX`` only to its own prefix,
``_INBOX.<user>``, and connects with that prefix (:func:`inbox_prefix`; ``shared/jetstream.connect`` derives it
from the URL's user), so no client can read another's replies. The permissions below list the JetStream API
subjects each part's own code calls; a part that needs a subject not listed here is refused by the server.
"""

from __future__ import annotations

import binascii
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, get_args

import nkeys

from .subjects import OPERATIONS, Names, encode_token

NatsRole = Literal["projector", "query", "ingest", "client", "operator"]
"""projector: creates the streams, consumes deltas, writes versions and dead letters (Postgres and Azure).
query: serves the request subjects in the workers' queue group. ingest: publishes deltas (of one workspace, or all).
client: requests answers (of one workspace, or all): the MCP gateway, ``ontofabric query``. operator: rebuilds,
dead-letter tools, ``eval``: the deployment's administrator, who may do anything in it."""
NATS_ROLES: tuple[NatsRole, ...] = get_args(NatsRole)

API = "$JS.API"


def inbox_prefix(user: str) -> str:
    """Where a user's replies arrive; the only ``_INBOX`` subjects it may subscribe to."""
    return f"_INBOX.{user}"


@dataclass(frozen=True)
class Permissions:
    publish: list[str]
    subscribe: list[str]
    publish_deny: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class NatsUser:
    name: str
    """The login name; for an nkey user its public key, which the server knows it by."""
    password: str
    """Empty for an nkey user: it proves its key by signing the server's nonce."""
    role: NatsRole
    prefix: str
    workspace: str | None = None
    """For ingest and client: the one workspace this user may touch; None: every workspace."""
    nkey: bool = False

    def permissions(self) -> Permissions:
        return role_permissions(self.role, Names(self.prefix), self.name, self.workspace)


def role_permissions(role: NatsRole, names: Names, user: str, workspace: str | None = None) -> Permissions:
    """What ``user`` playing ``role`` in the deployment ``names`` may do."""
    deltas, versions = names.delta_stream, names.version_stream
    manifests, legacy = f"KV_{names.manifest_bucket}", f"OBJ_{names.legacy_manifest_bucket}"
    snapshots = f"OBJ_{names.snapshot_bucket}"
    postgres_durables = names.every_postgres_projector_durable
    durables = [*postgres_durables, names.azure_projector_durable]
    stream_info = [f"{API}.STREAM.INFO.{stream}" for stream in names.streams]  # ensure_jetstream, every part
    inbox = [f"{inbox_prefix(user)}.>"]
    token = encode_token(workspace) if workspace is not None else "*"
    if role == "projector":
        return Permissions(
            publish=[
                *stream_info,
                *[f"{API}.STREAM.CREATE.{stream}" for stream in names.streams],  # the first start creates them
                # ensure_jetstream brings them to the configured replicas, and adds a republish an older one lacks
                *[f"{API}.STREAM.UPDATE.{stream}" for stream in (deltas, names.dlq_stream, versions, manifests)],
                *[f"{API}.CONSUMER.INFO.{deltas}.{durable}" for durable in durables],
                *[f"{API}.CONSUMER.CREATE.{deltas}.{durable}.>" for durable in durables],
                # An index lost (or a new one) behind a consumer that has delivered: read from the first delta again
                *[f"{API}.CONSUMER.DELETE.{deltas}.{durable}" for durable in durables],
                *[f"{API}.CONSUMER.MSG.NEXT.{deltas}.{durable}" for durable in durables],
                f"{API}.STREAM.MSG.GET.{deltas}",  # at start, what a crashed process had in hand (consumer.py)
                *[f"$JS.ACK.{deltas}.{durable}.>" for durable in durables],
                names.dlq_subjects,
                f"$KV.{names.version_bucket}.>",
                f"{API}.STREAM.MSG.GET.{versions}",
                f"{API}.DIRECT.GET.{versions}",
                f"{API}.DIRECT.GET.{versions}.>",
                f"{names.prefix}.version.>",
                # Moving an earlier version's manifests out of their shared object store (manifest_store.py).
                f"$KV.{names.manifest_bucket}.>",
                f"{API}.DIRECT.GET.{manifests}.>",
                f"{API}.STREAM.MSG.GET.{legacy}",
                f"{API}.STREAM.NAMES",  # nats-py finds the object store's stream by subject
                f"{API}.DIRECT.GET.{legacy}",
                f"{API}.DIRECT.GET.{legacy}.>",
                f"{API}.CONSUMER.CREATE.{legacy}",
                f"{API}.CONSUMER.CREATE.{legacy}.>",
                f"{API}.CONSUMER.DELETE.{legacy}.*",
                f"$JS.FC.{legacy}.>",
                f"{API}.STREAM.DELETE.{legacy}",
                # Reading the snapshots of a compacted stream into an empty index (snapshots.py).
                f"{API}.STREAM.MSG.GET.{snapshots}",
                f"{API}.DIRECT.GET.{snapshots}",
                f"{API}.DIRECT.GET.{snapshots}.>",
                f"{API}.CONSUMER.CREATE.{snapshots}",
                f"{API}.CONSUMER.CREATE.{snapshots}.>",
                f"{API}.CONSUMER.DELETE.{snapshots}.*",
                f"$JS.FC.{snapshots}.>",
                "_INBOX.>",  # answers to service discovery, into the asker's inbox
                # Which other projectors apply its consumers (worker.py, held_elsewhere): one process at a time.
                f"$SRV.PING.{names.projector_service}",
            ],
            subscribe=[
                *inbox,
                names.published_subjects,  # what the stream stored: each workspace's lag
                # Service discovery ($SRV.PING|INFO|STATS[.<name>[.<id>]]): each projector says it is there.
                "$SRV.*",
                f"$SRV.*.{names.projector_service}",
                f"$SRV.*.{names.projector_service}.*",
            ],
        )
    if role == "query":
        return Permissions(
            publish=[
                *stream_info,
                f"{API}.STREAM.MSG.GET.{deltas}",  # a workspace's last delta; the first delta past the index
                # The index's position (the lowest floor of the Postgres projectors' consumers).
                *[f"{API}.CONSUMER.INFO.{deltas}.{durable}" for durable in postgres_durables],
                # Counting deltas past the position: a named consumer of its own (published_after), never a
                # durable of the projectors, which a create request could otherwise reconfigure.
                f"{API}.CONSUMER.CREATE.{deltas}.*.{names.prefix}.delta.*.*",
                f"{API}.CONSUMER.DELETE.{deltas}.*",
                f"{API}.CONSUMER.CREATE.{versions}",  # the versions watch: an ordered consumer
                f"{API}.CONSUMER.INFO.{versions}.*",
                f"$JS.FC.{versions}.>",
                # Which partition layouts the running projectors serve (DeltaWatch): their consumers hold the position.
                f"$SRV.PING.{names.projector_service}",
                # Answers: to callers' inboxes only (the worker checks too). Not allow_responses, which would let
                # a request name any subject as its reply and have the worker write there.
                "_INBOX.>",
            ],
            publish_deny=[
                *[f"{API}.CONSUMER.CREATE.{deltas}.{durable}.>" for durable in durables],
                *[f"{API}.CONSUMER.DELETE.{deltas}.{durable}" for durable in durables],
            ],
            subscribe=[
                # Only in the workers' queue group: a query worker cannot take a workspace's requests for itself.
                *[f"{names.prefix}.{operation}.* {names.query_queue}" for operation in OPERATIONS],
                names.published_subjects,
                *inbox,
                # Service discovery ($SRV.PING|INFO|STATS[.<name>[.<id>]]): each worker says it is there.
                "$SRV.*",
                f"$SRV.*.{names.query_service}",
                f"$SRV.*.{names.query_service}.*",
            ],
        )
    if role == "ingest":
        return Permissions(
            # No stream info: it lists a stream's subjects, so every workspace's and branch's name.
            publish=[
                f"{names.prefix}.delta.{token}.*",
                *[f"{API}.CONSUMER.INFO.{deltas}.{durable}" for durable in postgres_durables],  # until projected
                # The manifests of what was published: keys under the workspace's token, read by key subject.
                f"$KV.{names.manifest_bucket}.{token}.>",
                f"{API}.DIRECT.GET.{manifests}.$KV.{names.manifest_bucket}.{token}.>",
                # Its workspace's status: its deltas are indexed once indexedSeq reaches its last publish's sequence
                # (an ingester of another language needs no consumer's name, nor the JetStream API).
                f"{names.prefix}.status.{token}",
            ],
            # Its workspace's dead letters as they are set aside: which of its deltas never reached the index.
            subscribe=[*inbox, names.dlq_subject(token)],
        )
    if role == "client":
        return Permissions(publish=[f"{names.prefix}.{operation}.{token}" for operation in OPERATIONS], subscribe=inbox)
    # operator: the deployment's own streams and subjects, every verb; nothing of another deployment on the server.
    return Permissions(
        publish=[
            f"{API}.INFO",
            f"{API}.STREAM.NAMES",
            f"{API}.STREAM.LIST",
            *[
                subject
                for stream in names.streams
                for subject in (
                    f"{API}.STREAM.*.{stream}",  # info, create, update, delete, purge
                    f"{API}.STREAM.MSG.*.{stream}",  # get, delete a message
                    f"{API}.DIRECT.GET.{stream}",
                    f"{API}.DIRECT.GET.{stream}.>",
                    f"{API}.CONSUMER.*.{stream}",  # create (unnamed), names, list
                    f"{API}.CONSUMER.*.{stream}.>",  # create (named), info, delete
                    f"{API}.CONSUMER.*.*.{stream}.*",  # next message, durable create
                    f"$JS.ACK.{stream}.>",
                    f"$JS.FC.{stream}.>",
                )
            ],
            f"$KV.{names.version_bucket}.>",
            f"$KV.{names.manifest_bucket}.>",
            f"$O.{names.legacy_manifest_bucket}.>",
            f"$O.{names.snapshot_bucket}.>",
            f"{names.prefix}.>",
            f"$SRV.*.{names.query_service}",  # which query workers are there (ontofabric status)
            f"$SRV.*.{names.projector_service}",  # and which projectors
        ],
        subscribe=[f"{names.prefix}.>", *inbox],  # watching versions and deltas go by; not others' replies
    )


MAX_SUBSCRIPTIONS_PER_CONNECTION = 10_000
"""What one connection may hold (nats-server's ``max_subscriptions``): a part of this deployment holds a few dozen,
and a tenant's client held 200,000, the server's memory growing from 26 to 390 MiB (a hostile tester's). Per
connection only: a server configured by users, not accounts, has no limit per user."""


def render_config(
    host: str,
    port: int,
    store_dir: str | None,
    users: Mapping[str, NatsUser],
    server_name: str = "ontofabric-embedded",
    extra: Mapping[str, object] | None = None,
) -> str:
    """A nats-server configuration: JetStream storing in ``store_dir`` (None: JetStream off), ``users``
    (passwords inline: the file must be readable by its owner only), and ``extra`` top-level blocks (a cluster's,
    monitoring). The users stay in the server's global account, where streams made before authentication was on
    are kept: a data directory from an earlier version keeps its deltas."""
    entries = []
    for user in users.values():
        permissions = user.permissions()
        publish: dict[str, list[str]] = {"allow": permissions.publish}
        if permissions.publish_deny:
            publish["deny"] = permissions.publish_deny
        rules: dict[str, object] = {"publish": publish, "subscribe": {"allow": permissions.subscribe}}
        login = {"nkey": user.name} if user.nkey else {"user": user.name, "password": user.password}
        entries.append({**login, "permissions": rules})
    # The configuration format reads JSON: every string quoted, so "$JS..." subjects are not variables.
    config = {
        "host": host,
        "port": port,
        "server_name": server_name,
        "max_subscriptions": MAX_SUBSCRIPTIONS_PER_CONNECTION,
        **({"jetstream": {"store_dir": store_dir}} if store_dir is not None else {}),
        "authorization": {"users": entries},
        **(extra or {}),
    }
    return json.dumps(config, indent=2)


def compose_password_variable(role: NatsRole) -> str:
    """The environment variable compose.yaml hands a role's NATS password in."""
    return f"NATS_{role.upper()}_PASSWORD"


def compose_nats_config() -> str:
    """compose.yaml's nats-server configuration (``infra/nats/nats.conf``): a user per role of the default
    deployment, named as the role, with the role's permissions; each password the server reads from its
    environment (``$NATS_<ROLE>_PASSWORD``, which compose passes to it and puts in that role's URLs)."""
    prefix = Names().prefix
    users: dict[str, NatsUser] = {
        role: NatsUser(role, f"${compose_password_variable(role)}", role, prefix, None) for role in NATS_ROLES
    }
    config = render_config("0.0.0.0", 4222, "/data", users, server_name="ontofabric", extra={"http_port": 8222})
    for role in NATS_ROLES:  # unquoted: a variable of the server's configuration, read from its environment
        variable = compose_password_variable(role)
        config = config.replace(f'"${variable}"', f"${variable}")
    return config + "\n"


def new_nkey_seed() -> tuple[str, str]:
    """A new user nkey: (seed, public key). The seed is the secret; the server is told only the public key."""
    seed = nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER)
    return seed.decode(), str(nkeys.from_seed(bytearray(seed)).public_key.decode())


class BadCredentials(ValueError):
    """A credentials file that cannot be what its setting says (the message names the file, never its content)."""


def nkey_public_key(seed_file: Path) -> str:
    """The public key of the user nkey seed in ``seed_file``: the user the server knows, and its inbox prefix."""
    try:
        seed = seed_file.read_bytes().strip()
        public = str(nkeys.from_seed(bytearray(seed)).public_key.decode())
    except (OSError, nkeys.NkeysError, binascii.Error, ValueError) as error:
        raise BadCredentials(f"{seed_file} does not hold a readable nkey seed ({type(error).__name__})") from None
    if not public.startswith("U"):
        raise BadCredentials(f"{seed_file} holds the seed of an nkey that is not a user's")
    return public
