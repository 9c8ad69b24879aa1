-- Exact identifiers: a query that is a symbol's name looks its definitions up by the last dotted part of their
-- qualified name, ignoring case (services/query/postgres.py SYMBOL_NAME_SQL is the same expression, so that this
-- index serves it). Declared on the parent, so every workspace partition, and a rebuild's shadow, gets one.
-- On a large existing index this build holds writes off the documents table for its duration.
CREATE INDEX IF NOT EXISTS documents_symbol_name
    ON documents (workspace, (lower(regexp_replace(symbol_fqn, '^.*[.]', ''))));
