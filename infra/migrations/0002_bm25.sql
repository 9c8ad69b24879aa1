-- BM25 inside PostgreSQL: ts_rank_cd has no inverse document frequency, so the projector keeps postings
-- (term frequency per document) and per-branch corpus statistics, and the keyword retriever scores BM25 from them.
-- This ships with 0001 (no deployment predates it), so there is nothing to backfill.

ALTER TABLE documents ADD COLUMN doc_length integer NOT NULL DEFAULT 0;

-- The one definition of how text becomes lexemes, for documents and queries: the configuration's parser and
-- stemmer, without one-character lexemes (loop variables, single letters) that only add noise to BM25.
CREATE FUNCTION index_tsvector(config regconfig, body text) RETURNS tsvector
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT ts_delete(v, ARRAY(SELECT lexeme FROM unnest(v) WHERE length(lexeme) < 2))
    FROM to_tsvector(config, body) AS v
$$;

-- One row per (term, document): the term frequency and the document's length.
CREATE TABLE postings (
    workspace  text    NOT NULL,
    branch     text    NOT NULL,
    term       text    NOT NULL,
    doc_id     text    NOT NULL,
    tf         integer NOT NULL,
    doc_length integer NOT NULL,
    -- INCLUDE: scoring reads tf and doc_length from the index itself (index-only once vacuum has run).
    PRIMARY KEY (workspace, branch, term, doc_id) INCLUDE (tf, doc_length)
) PARTITION BY LIST (workspace);
-- No index by document: the projector finds a document's postings through its stored tsvector (the terms), so
-- every postings read is a primary-key range scan and the planner has no wrong index to choose.

-- Live documents and their summed length per (workspace, branch): N and avgdl of BM25.
ALTER TABLE ontology_versions
    ADD COLUMN doc_count    bigint NOT NULL DEFAULT 0,
    ADD COLUMN total_length bigint NOT NULL DEFAULT 0;

CREATE OR REPLACE FUNCTION ensure_workspace_partition(p_workspace text) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    suffix text := substr(md5(p_workspace), 1, 20);
BEGIN
    IF EXISTS (SELECT 1 FROM workspaces WHERE workspace = p_workspace) THEN
        RETURN;
    END IF;
    PERFORM pg_advisory_xact_lock(hashtext('ontofabric.partition'), hashtext(p_workspace));
    IF EXISTS (SELECT 1 FROM workspaces WHERE workspace = p_workspace) THEN
        RETURN;
    END IF;
    EXECUTE format('CREATE TABLE %I PARTITION OF documents FOR VALUES IN (%L)', 'documents_ws_' || suffix, p_workspace);
    EXECUTE format('CREATE TABLE %I PARTITION OF postings FOR VALUES IN (%L)', 'postings_ws_' || suffix, p_workspace);
    INSERT INTO workspaces (workspace, partition_name) VALUES (p_workspace, 'documents_ws_' || suffix);
END
$$;
