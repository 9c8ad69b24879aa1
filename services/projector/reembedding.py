"""Embedding again, by the model the index holds, the documents deltas carry with another model's vectors.

While an embedding model change is under way (``ontofabric reembed``) and after it, ingesters may still publish
vectors of the model the index held before, and the stream holds them from before the change: a projector (or a
rebuild) set up with both models embeds such a document again, from its text, rather than refusing it. The store
says which model the index holds, inside the batch's transaction (:class:`ModelChanged`), so a batch never writes
one model's vectors beside another's.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Sequence

from nats.aio.msg import Msg

from ontofabric.contracts import DocumentUpserted, TokenVectors
from ontofabric.shared.db import Connection, IndexModel, index_model
from ontofabric.shared.embedder import Embedder, embedding_text, load_embedder
from ontofabric.shared.late_interaction import pack_signs
from ontofabric.shared.logging import get_logger
from ontofabric.shared.settings import Settings

from .planning import Delta, Limits, embedded_by_another, upserted_document

log = get_logger(__name__)


class ModelChanged(Exception):
    """The index holds another embedding model's vectors than the batch carries."""

    def __init__(self, index: IndexModel) -> None:
        super().__init__(f"the index holds {index.model} vectors")
        self.index = index


class Reembedder:
    """The models a projector may embed with (``settings.models()``: the current one, and the next while a change
    is set), each loaded on first use; the one the index holds as last seen, and the models whose documents are
    embedded again by it: those the index held before, and this process's. A document of any other model is
    refused, as before any change: embedding it would be work a stray publisher could ask for."""

    def __init__(self, settings: Settings) -> None:
        self._models = settings.models()
        self._loaded: dict[str, Embedder] = {}
        self.model = settings.embedding_model
        self._accepted = frozenset(self._models)
        self._unknown: set[str] = set()

    def follow(self, index: IndexModel) -> bool:
        """The index holds ``index.model`` now. False when this process has no such model (the log says so once):
        documents of another model are refused then, until it is restarted with it."""
        self._accepted = frozenset(self._models) | set(index.previous)
        if index.model not in self._models:
            if index.model not in self._unknown:
                self._unknown.add(index.model)
                log.error("embedding_model_unknown", index_model=index.model, models=sorted(self._models))
            return False
        if index.model != self.model:
            log.info("embedding_model_followed", previous=self.model, model=index.model)
            self.model = index.model
        return True

    def limits(self, base: Limits) -> Limits:
        """``base`` for the model the index holds, letting through documents that are to be embedded again."""
        settings = self._models[self.model]
        return dataclasses.replace(
            base, embedding_model=self.model, embedding_dim=settings.embedding_dim, reembeddable=self._accepted
        )

    def stale(self, delta: Delta) -> bool:
        document = upserted_document(delta.envelope)
        return document is not None and embedded_by_another(document, self.model)

    async def refresh(self, accepted: Sequence[tuple[Msg, Delta]]) -> list[tuple[Msg, Delta]]:
        """The batch with every stale document embedded again by the index's model (on a thread)."""
        stale = [i for i, (_, delta) in enumerate(accepted) if self.stale(delta)]
        if not stale:
            return list(accepted)
        model = self.model
        embedder = self._loaded.get(model)
        if embedder is None:
            embedder = self._loaded[model] = await asyncio.to_thread(load_embedder, self._models[model], False)
        documents = [upserted_document(accepted[i][1].envelope) for i in stale]
        texts = [embedding_text(d.content, d.metadata.symbol_fqn) for d in documents if d is not None]
        vectors, tokens = await asyncio.to_thread(embedder.embed_with_tokens, texts)
        refreshed = list(accepted)
        for i, vector, token_matrix in zip(stale, vectors, tokens, strict=True):
            msg, delta = accepted[i]
            document = upserted_document(delta.envelope)
            assert document is not None
            signs = None
            # Token vectors go on when the delta had them and the model's tokens are as wide as its vectors.
            if document.token_vectors is not None and token_matrix.shape[1] == embedder.dimension:
                signs = TokenVectors.of_signs(embedder.dimension, pack_signs(token_matrix))
            document = document.model_copy(
                update={"embedding": [float(x) for x in vector], "embedding_model": model, "token_vectors": signs}
            )
            envelope = delta.envelope.model_copy(update={"payload": DocumentUpserted(document=document)})
            refreshed[i] = (msg, dataclasses.replace(delta, envelope=envelope, reembedded=model))
        log.info("documents_embedded_again", model=model, documents=len(stale))
        return refreshed


async def reembedder_for(settings: Settings, conn: Connection) -> Reembedder | None:
    """What embeds again, for the model the database's index holds, documents another model embedded (a model
    change); None without a local embedder: those are refused then. The projector's rule, which whatever judges
    deltas as the projector did (a compaction) follows too."""
    if settings.embedder == "none":
        return None
    reembedder = Reembedder(settings)
    reembedder.follow(await index_model(conn))
    return reembedder
