-- Projectors write rows and nothing else: they act as ontofabric_writer, which may read and write every table's rows
-- but not create, alter or drop tables. The one piece of DDL a projector needs, a new workspace's partitions, runs in
-- ensure_workspace_partition as the function's owner (SECURITY DEFINER, with its search path pinned to this schema so
-- a caller's temporary tables cannot stand in for ours). Migrations and rebuilds (schemas, partition swaps) stay with
-- the owner. Like 0011: the role is per cluster, the grants per schema, and the default privileges cover tables and
-- partitions the owner creates later.
DO $$
BEGIN
    IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = 'ontofabric_writer') THEN
        CREATE ROLE ontofabric_writer NOLOGIN;
    END IF;
EXCEPTION WHEN duplicate_object OR unique_violation THEN
    NULL;  -- another database of the cluster created it at the same moment
END $$;

DO $$
DECLARE
    maintain text := CASE WHEN current_setting('server_version_num')::int >= 170000 THEN ', MAINTAIN' ELSE '' END;
BEGIN
    -- MAINTAIN (PostgreSQL 17+) lets the projector ANALYZE the partitions it fills; on older servers ANALYZE by a
    -- non-owner only warns and skips, and autovacuum keeps the statistics.
    EXECUTE format('GRANT USAGE ON SCHEMA %I TO ontofabric_writer', current_schema());
    EXECUTE format('GRANT SELECT, INSERT, UPDATE, DELETE%s ON ALL TABLES IN SCHEMA %I TO ontofabric_writer',
                   maintain, current_schema());
    EXECUTE format('GRANT USAGE, SELECT, UPDATE ON ALL SEQUENCES IN SCHEMA %I TO ontofabric_writer', current_schema());
    EXECUTE format('ALTER DEFAULT PRIVILEGES IN SCHEMA %I GRANT SELECT, INSERT, UPDATE, DELETE%s ON TABLES '
                   'TO ontofabric_writer', current_schema(), maintain);
    EXECUTE format('ALTER DEFAULT PRIVILEGES IN SCHEMA %I GRANT USAGE, SELECT, UPDATE ON SEQUENCES '
                   'TO ontofabric_writer', current_schema());
    EXECUTE format('ALTER FUNCTION ensure_workspace_partition(text) SECURITY DEFINER SET search_path = %I, public, '
                   'pg_temp', current_schema());
    EXECUTE format('REVOKE EXECUTE ON FUNCTION ensure_workspace_partition(text) FROM PUBLIC');
    EXECUTE format('GRANT EXECUTE ON FUNCTION ensure_workspace_partition(text) TO ontofabric_writer');
END $$;
