-- A new workspace's partitions are made apart and then attached, where they were made with CREATE TABLE ... PARTITION
-- OF. That form takes ACCESS EXCLUSIVE on the parent: queued behind any long reader of the parent (a slow query, an
-- operator's transaction), it held every tenant's reads queued behind it for as long (an outside tester's: 2-5 s
-- answers at 1,400 workspaces while a new one was made). ATTACH PARTITION takes SHARE UPDATE EXCLUSIVE on the parent,
-- which readers' and writers' locks do not conflict with, and builds the parent's indexes on the empty table.
CREATE OR REPLACE FUNCTION ensure_workspace_partition(p_workspace text) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    suffix text := substr(md5(p_workspace), 1, 20);
    parent text;
    part text;
BEGIN
    IF EXISTS (SELECT 1 FROM workspaces WHERE workspace = p_workspace) THEN
        RETURN;
    END IF;
    PERFORM pg_advisory_xact_lock(hashtext('ontofabric.partition'), hashtext(p_workspace));
    IF EXISTS (SELECT 1 FROM workspaces WHERE workspace = p_workspace) THEN
        RETURN;
    END IF;
    FOREACH parent IN ARRAY ARRAY['documents', 'postings', 'term_statistics'] LOOP
        part := parent || '_ws_' || suffix;
        EXECUTE format('CREATE TABLE %I (LIKE %I INCLUDING ALL EXCLUDING INDEXES)', part, parent);
        EXECUTE format('ALTER TABLE %I ATTACH PARTITION %I FOR VALUES IN (%L)', parent, part, p_workspace);
    END LOOP;
    INSERT INTO workspaces (workspace, partition_name) VALUES (p_workspace, 'documents_ws_' || suffix);
END
$$;

-- CREATE OR REPLACE resets what 0012 set: the function runs as its owner again, with its search path pinned.
DO $$
BEGIN
    EXECUTE format('ALTER FUNCTION ensure_workspace_partition(text) SECURITY DEFINER SET search_path = %I, public, '
                   'pg_temp', current_schema());
END $$;
