"""Where each workspace's rows live: the PostgreSQL database of its partition.

Workspaces fall into the projectors' partitions by a hash of their name (:class:`~.subjects.Partition`), and
partition ``i`` lives on the ``i mod n``-th of the ``n`` databases: the projectors of a partition write there, the
query workers and rebuilds of its workspaces read and rebuild there. More databases take more of the writes; a
new layout is a new set of consumers replaying the stream into the new places.
"""

from __future__ import annotations

from dataclasses import dataclass

from .settings import Settings
from .subjects import encode_token, partition_of_token


@dataclass(frozen=True)
class Placement:
    partitions: int
    databases: tuple[str, ...]
    """The databases' URLs, partition i on ``databases[i % len(databases)]``."""

    @classmethod
    def of(cls, settings: Settings, database_url: str) -> Placement:
        """The deployment's placement; ``database_url``: the one database when no partition has its own."""
        return cls(settings.projector_partitions, settings.partition_database_urls() or (database_url,))

    def partition_of(self, workspace: str) -> int:
        return partition_of_token(encode_token(workspace), self.partitions)

    def database_of_partition(self, partition: int) -> int:
        """The index in ``databases`` of the database a partition lives on."""
        return partition % len(self.databases)

    def database_of(self, workspace: str) -> int:
        """The index in ``databases`` of the database a workspace lives on."""
        return self.database_of_partition(self.partition_of(workspace))

    def database_url_of(self, workspace: str) -> str:
        return self.databases[self.database_of(workspace)]
