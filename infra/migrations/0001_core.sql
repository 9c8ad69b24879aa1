-- Core schema: documents (partitioned by workspace), ontology graph, ontology versions.
-- {{embedding_dim}} is the deployment's vector dimension, fixed when this migration first runs;
-- changing it later means rebuilding the index from the stream.

CREATE EXTENSION IF NOT EXISTS vector;

-- What the index was built with; the projector and query workers refuse to run against a different model.
CREATE TABLE deployment (
    singleton       boolean PRIMARY KEY DEFAULT true CHECK (singleton),
    embedding_model text        NOT NULL,
    embedding_dim   integer     NOT NULL,
    created_at      timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE workspaces (
    workspace      text PRIMARY KEY,
    partition_name text NOT NULL UNIQUE,
    created_at     timestamptz NOT NULL DEFAULT now()
);

-- One row per (workspace, branch, id). A delete leaves a tombstone (deleted = true) so that an older upsert
-- arriving later cannot resurrect the document: every row remembers the stream sequence that wrote it.
CREATE TABLE documents (
    workspace       text        NOT NULL,
    branch          text        NOT NULL,
    id              text        NOT NULL,
    deleted         boolean     NOT NULL DEFAULT false,
    content         text        NOT NULL DEFAULT '',
    object_type     text,
    source_domain   text,
    symbol_key      text,
    symbol_kind     text,
    symbol_fqn      text,
    content_hash    text,
    file_path       text,
    chunk_level     text,
    provenance      text,
    metadata        jsonb       NOT NULL DEFAULT '{}',
    embedding       vector({{embedding_dim}}),
    embedding_model text,
    search_vector   tsvector    NOT NULL DEFAULT ''::tsvector,
    indexed_at      timestamptz,
    stream_seq      bigint      NOT NULL,
    event_id        text        NOT NULL,
    updated_at      timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (workspace, branch, id)
) PARTITION BY LIST (workspace);

-- Declared on the parent, so every workspace partition gets its own HNSW and GIN index.
CREATE INDEX documents_embedding_hnsw ON documents USING hnsw (embedding vector_cosine_ops);
CREATE INDEX documents_search_gin ON documents USING gin (search_vector);
CREATE INDEX documents_object_type ON documents (workspace, branch, object_type);
CREATE INDEX documents_symbol_key ON documents (workspace, branch, symbol_key);

-- Creates the workspace's partition once; concurrent projectors serialise on an advisory lock.
CREATE FUNCTION ensure_workspace_partition(p_workspace text) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    part text := 'documents_ws_' || substr(md5(p_workspace), 1, 20);
BEGIN
    IF EXISTS (SELECT 1 FROM workspaces WHERE workspace = p_workspace) THEN
        RETURN;
    END IF;
    PERFORM pg_advisory_xact_lock(hashtext('ontofabric.partition'), hashtext(p_workspace));
    IF EXISTS (SELECT 1 FROM workspaces WHERE workspace = p_workspace) THEN
        RETURN;
    END IF;
    EXECUTE format('CREATE TABLE %I PARTITION OF documents FOR VALUES IN (%L)', part, p_workspace);
    INSERT INTO workspaces (workspace, partition_name) VALUES (p_workspace, part);
END
$$;

CREATE TABLE ontology_nodes (
    workspace   text        NOT NULL,
    branch      text        NOT NULL,
    object_type text        NOT NULL,
    deleted     boolean     NOT NULL DEFAULT false,
    domain      text,
    name        text,
    kind        text,
    interfaces  text[]      NOT NULL DEFAULT '{}',
    description text,
    stream_seq  bigint      NOT NULL,
    event_id    text        NOT NULL,
    updated_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (workspace, branch, object_type)
);

CREATE TABLE ontology_links (
    workspace   text        NOT NULL,
    branch      text        NOT NULL,
    source_type text        NOT NULL,
    link_name   text        NOT NULL,
    target_type text        NOT NULL,
    deleted     boolean     NOT NULL DEFAULT false,
    stream_seq  bigint      NOT NULL,
    event_id    text        NOT NULL,
    updated_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (workspace, branch, source_type, link_name, target_type)
);

-- The ontologyVersion of (workspace, branch): a hash of the projected state (a sum of per-row hashes, so it
-- depends only on which rows hold which stream sequence) and the highest stream sequence applied. `revision`
-- counts the commits that changed it: announcements compare revisions, never older over newer.
CREATE TABLE ontology_versions (
    workspace  text        NOT NULL,
    branch     text        NOT NULL,
    state_hash bigint      NOT NULL DEFAULT 0,
    stream_seq bigint      NOT NULL DEFAULT 0,
    revision   bigint      NOT NULL DEFAULT 0,
    updated_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (workspace, branch)
);

-- Every event id the projector has handled (applied or found stale): a copy republished after JetStream's
-- duplicate window is a no-op too. Dead-lettered events are not here, so they can be re-driven.
CREATE TABLE handled_events (
    event_id   text   PRIMARY KEY,
    stream_seq bigint NOT NULL
);
