-- Callers: a question for a symbol's callers finds the chunks whose metadata.calls (from the ingester's static
-- analysis) names it (services/query/postgres.py DocumentStore.callers). Only chunks that call something are
-- indexed: most documents (docstrings, prose, other ingesters' documents) carry no calls and cost nothing here.
-- Declared on the parent, so every workspace partition, and a rebuild's shadow, gets one.
-- On a large existing index this build holds writes off the documents table while it reads every row; its
-- duration was not measured.
CREATE INDEX IF NOT EXISTS documents_calls
    ON documents USING gin ((metadata -> 'calls')) WHERE metadata ? 'calls';
