-- Planner statistics of a workspace's partitions, refreshed by the projector as it writes. Without them a new or
-- fast-growing workspace waits for autovacuum (a minute or more after the writes) and is planned meanwhile as an
-- empty table: a filtered keyword query then scanned the whole documents partition once per scored document.
--
-- The rule is autovacuum's (rows changed since the last ANALYZE above threshold + scale * rows), checked right after
-- the projector's own writes. A projector that finds another one analysing the workspace skips it.
CREATE FUNCTION analyze_stale_workspace_partitions(p_workspace text, p_threshold bigint, p_scale float8)
RETURNS text[]
LANGUAGE plpgsql AS $$
DECLARE
    suffix   text := substr(md5(p_workspace), 1, 20);  -- as ensure_workspace_partition names them
    part     text;
    analysed text[] := '{}';
BEGIN
    IF NOT pg_try_advisory_xact_lock(hashtext('ontofabric.analyze'), hashtext(p_workspace)) THEN
        RETURN analysed;
    END IF;
    FOR part IN
        SELECT s.relname FROM pg_stat_user_tables s JOIN pg_class c ON c.oid = s.relid
         WHERE s.relname IN ('documents_ws_' || suffix, 'postings_ws_' || suffix)
           AND s.n_mod_since_analyze > p_threshold + p_scale * greatest(c.reltuples, 0)
         ORDER BY s.relname
    LOOP
        EXECUTE format('ANALYZE %I', part);
        analysed := analysed || part;
    END LOOP;
    RETURN analysed;
END
$$;
