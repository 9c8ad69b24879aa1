-- Query workers only read: they connect as (or SET ROLE to) ontofabric_reader, which may SELECT and nothing else,
-- so no query path can write, whatever a request holds. Roles are per cluster; the grants are per schema (a
-- rebuild's shadow schema gets its own). Tables later migrations create are granted by the default privileges
-- below, which hold for tables created by the role that runs the migrations (projectors, rebuilds, `migrate`).
DO $$
BEGIN
    IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = 'ontofabric_reader') THEN
        CREATE ROLE ontofabric_reader NOLOGIN;
    END IF;
EXCEPTION WHEN duplicate_object OR unique_violation THEN
    NULL;  -- another database of the cluster created it at the same moment
END $$;

DO $$
BEGIN
    EXECUTE format('GRANT USAGE ON SCHEMA %I TO ontofabric_reader', current_schema());
    EXECUTE format('GRANT SELECT ON ALL TABLES IN SCHEMA %I TO ontofabric_reader', current_schema());
    EXECUTE format('ALTER DEFAULT PRIVILEGES IN SCHEMA %I GRANT SELECT ON TABLES TO ontofabric_reader',
                   current_schema());
END $$;
