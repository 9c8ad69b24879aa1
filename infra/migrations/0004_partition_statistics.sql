-- Planner statistics of a workspace's partitions, refreshed by the projector as it writes. Without them a new or
-- fast-growing workspace waits for autovacuum (a minute or more after the writes) and is planned meanwhile as an
-- empty table: a filtered keyword query then scanned the whole documents partition once per scored document.
--
-- This lists the partitions of some workspaces whose rows changed since their last ANALYZE by more than
-- autovacuum's own rule (threshold + scale * rows); the projector analyses each in a transaction of its own.
CREATE FUNCTION stale_workspace_partitions(p_workspaces text[], p_threshold bigint, p_scale float8)
RETURNS SETOF text
LANGUAGE sql STABLE AS $$
    SELECT format('%I', s.relname)
      FROM pg_stat_user_tables s JOIN pg_class c ON c.oid = s.relid
     WHERE s.relname IN (
               -- named as ensure_workspace_partition names them
               SELECT prefix || substr(md5(w), 1, 20)
                 FROM unnest(p_workspaces) AS w, unnest(ARRAY['documents_ws_', 'postings_ws_']) AS prefix)
       AND s.n_mod_since_analyze > p_threshold + p_scale * greatest(c.reltuples, 0)
     ORDER BY 1
$$;
