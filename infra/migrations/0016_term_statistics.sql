-- Document frequency per (workspace, branch, term), kept by the projector in the transaction that writes the
-- postings. BM25 read it by counting a term's postings, 0.2 µs a posting for every query term (a common term holds
-- tens of thousands at 100,000 documents); here it is one index lookup a term. Knowing every term's frequency before
-- reading any postings is also what lets the keyword retriever read the rare terms in full and look the common ones
-- up only for the documents that can still rank (services/query/postgres.py, PostgresKeyword).
-- A term whose last document went kept its row at 0 here; since migration 0021 the row goes (store.py).
CREATE TABLE term_statistics (
    workspace text    NOT NULL,
    branch    text    NOT NULL,
    term      text    NOT NULL,
    df        integer NOT NULL,
    PRIMARY KEY (workspace, branch, term)
) PARTITION BY LIST (workspace);

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
    EXECUTE format('CREATE TABLE %I PARTITION OF term_statistics FOR VALUES IN (%L)', 'term_statistics_ws_' || suffix,
                   p_workspace);
    INSERT INTO workspaces (workspace, partition_name) VALUES (p_workspace, 'documents_ws_' || suffix);
END
$$;

-- CREATE OR REPLACE resets what 0012 set: the function runs as its owner again, with its search path pinned.
DO $$
BEGIN
    EXECUTE format('ALTER FUNCTION ensure_workspace_partition(text) SECURITY DEFINER SET search_path = %I, public, '
                   'pg_temp', current_schema());
END $$;

-- Existing workspaces: their partition, filled from their postings.
DO $$
DECLARE
    ws text;
BEGIN
    FOR ws IN SELECT workspace FROM workspaces LOOP
        EXECUTE format('CREATE TABLE %I PARTITION OF term_statistics FOR VALUES IN (%L)',
                       'term_statistics_ws_' || substr(md5(ws), 1, 20), ws);
    END LOOP;
END
$$;

-- Projectors of the previous version keep writing postings but not their counts: none may write while these are
-- counted (stop them before upgrading; a projector of this version waits for this migration).
LOCK TABLE postings IN SHARE MODE;
INSERT INTO term_statistics (workspace, branch, term, df)
SELECT workspace, branch, term, count(*) FROM postings GROUP BY workspace, branch, term;

-- Projectors analyse the new partitions too: every batch changes their rows.
CREATE OR REPLACE FUNCTION stale_workspace_partitions(p_workspaces text[], p_threshold bigint, p_scale float8)
RETURNS SETOF text
LANGUAGE sql STABLE AS $$
    SELECT format('%I', s.relname)
      FROM pg_stat_user_tables s JOIN pg_class c ON c.oid = s.relid
     WHERE s.schemaname = current_schema()
       AND s.relname IN (
               -- named as ensure_workspace_partition names them
               SELECT prefix || substr(md5(w), 1, 20)
                 FROM unnest(p_workspaces) AS w,
                      unnest(ARRAY['documents_ws_', 'postings_ws_', 'term_statistics_ws_']) AS prefix)
       AND s.n_mod_since_analyze > p_threshold + p_scale * greatest(c.reltuples, 0)
     ORDER BY 1
$$;
