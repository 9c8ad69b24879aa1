-- BM25 inside PostgreSQL: ts_rank_cd has no inverse document frequency, so the projector keeps postings
-- (term frequency per document) and per-branch corpus statistics, and the keyword retriever scores BM25 from them.

ALTER TABLE documents ADD COLUMN doc_length integer NOT NULL DEFAULT 0;

-- The one definition of how text becomes lexemes, for documents and queries: the configuration's parser and
-- stemmer, without one-character lexemes (loop variables, single letters) that only add noise to BM25.
CREATE FUNCTION index_tsvector(config regconfig, body text) RETURNS tsvector
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT ts_delete(v, ARRAY(SELECT lexeme FROM unnest(v) WHERE length(lexeme) < 2))
    FROM to_tsvector(config, body) AS v
$$;

-- One row per (term, document): the term frequency and the document's length, for index-only scoring.
CREATE TABLE postings (
    workspace  text    NOT NULL,
    branch     text    NOT NULL,
    term       text    NOT NULL,
    doc_id     text    NOT NULL,
    tf         integer NOT NULL,
    doc_length integer NOT NULL,
    PRIMARY KEY (workspace, branch, term, doc_id)
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

-- Existing workspaces: their postings partition, then postings and statistics from the stored tsvectors.
DO $$
DECLARE
    ws text;
BEGIN
    FOR ws IN SELECT workspace FROM workspaces LOOP
        EXECUTE format('CREATE TABLE %I PARTITION OF postings FOR VALUES IN (%L)',
                       'postings_ws_' || substr(md5(ws), 1, 20), ws);
    END LOOP;
END
$$;

UPDATE documents d
   SET doc_length = (SELECT coalesce(sum(coalesce(cardinality(u.positions), 1)), 0) FROM unnest(d.search_vector) u)
 WHERE NOT d.deleted;

INSERT INTO postings (workspace, branch, term, doc_id, tf, doc_length)
SELECT d.workspace, d.branch, u.lexeme, d.id, coalesce(cardinality(u.positions), 1), d.doc_length
  FROM documents d CROSS JOIN LATERAL unnest(d.search_vector) u
 WHERE NOT d.deleted;

UPDATE ontology_versions v
   SET doc_count = s.doc_count, total_length = s.total_length
  FROM (SELECT workspace, branch, count(*) AS doc_count, sum(doc_length) AS total_length
          FROM documents WHERE NOT deleted GROUP BY workspace, branch) s
 WHERE v.workspace = s.workspace AND v.branch = s.branch;
