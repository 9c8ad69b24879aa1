-- Names a chunk assigns at its level (metadata.defines: a module's constants, a class's attributes, which have no
-- chunk of their own): a query that is such a name finds the chunk assigning it (services/query/postgres.py
-- DocumentStore.definitions). Only chunks that assign something are indexed, as with documents_calls (0017).
-- Declared on the parent, so every workspace partition, and a rebuild's shadow, gets one.
CREATE INDEX IF NOT EXISTS documents_defines
    ON documents USING gin ((metadata -> 'defines')) WHERE metadata ? 'defines';
-- And the other qualified names a chunk's symbol is published under (metadata.aliases: click.Option for
-- click.core.Option), matched whole.
CREATE INDEX IF NOT EXISTS documents_aliases
    ON documents USING gin ((metadata -> 'aliases')) WHERE metadata ? 'aliases';
