-- `ontofabric status` and a starting projector count the live documents of another analysis than theirs per
-- workspace (infra/migrations/0024): this index makes that a look at the few such rows (none once rebuilt), not a
-- scan of every document. Building it holds off projection (queries go on) for seconds per million documents.
CREATE INDEX documents_analysis_version ON documents (analysis_version, workspace) WHERE NOT deleted;
