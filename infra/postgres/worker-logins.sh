#!/bin/sh
# compose's PostgreSQL, at its first start (docker-entrypoint-initdb.d): the query workers' login, holding the
# reader role (migration 0011) and nothing more, as `ontofabric up` makes it (shared/runtime.py, WORKER_LOGINS).
# A worker acting as the reader through the superuser's login (the `role` startup parameter) could leave the role
# within its session. Its password: POSTGRES_QUERY_PASSWORD; its name: POSTGRES_QUERY_LOGIN (ontofabric_query).
set -eu
psql -v ON_ERROR_STOP=1 -q --username "$POSTGRES_USER" --dbname "$POSTGRES_DB" \
    -v login="${POSTGRES_QUERY_LOGIN:-ontofabric_query}" -v password="$POSTGRES_QUERY_PASSWORD" <<'SQL'
SELECT NOT EXISTS (SELECT FROM pg_roles WHERE rolname = 'ontofabric_reader') AS no_reader,
       NOT EXISTS (SELECT FROM pg_roles WHERE rolname = :'login') AS no_login \gset
\if :no_reader
    CREATE ROLE ontofabric_reader NOLOGIN;
\endif
\if :no_login
    CREATE ROLE :"login" LOGIN;
\endif
ALTER ROLE :"login" LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE NOREPLICATION NOBYPASSRLS PASSWORD :'password';
GRANT ontofabric_reader TO :"login";
SQL
