-- The partitions a projector analyses are those of the schema it writes: a rebuild's shadow tables (a schema of
-- their own, the same partition names) and the live ones are analysed each by their own writer. An unqualified
-- name is found in the current schema first.
CREATE OR REPLACE FUNCTION stale_workspace_partitions(p_workspaces text[], p_threshold bigint, p_scale float8)
RETURNS SETOF text
LANGUAGE sql STABLE AS $$
    SELECT format('%I', s.relname)
      FROM pg_stat_user_tables s JOIN pg_class c ON c.oid = s.relid
     WHERE s.schemaname = current_schema()
       AND s.relname IN (
               -- named as ensure_workspace_partition names them
               SELECT prefix || substr(md5(w), 1, 20)
                 FROM unnest(p_workspaces) AS w, unnest(ARRAY['documents_ws_', 'postings_ws_']) AS prefix)
       AND s.n_mod_since_analyze > p_threshold + p_scale * greatest(c.reltuples, 0)
     ORDER BY 1
$$;
