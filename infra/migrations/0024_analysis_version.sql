-- Which analysis of the projector made each document's keyword index (services/projector/planning.py,
-- ANALYSIS_VERSION): a change to what it derives from a document (2026-11-30: a code symbol's own name weighed)
-- reaches only what is projected after it, so an index projected before is mixed until `ontofabric rebuild W`, and
-- nothing could tell. Rows written before this migration, or by a projector of an earlier release still running,
-- read 0. A constant default adds the column without rewriting the table.
ALTER TABLE documents ADD COLUMN analysis_version smallint NOT NULL DEFAULT 0;
-- `ontofabric status` and a starting projector count the live documents of another analysis than theirs per
-- workspace: this index makes that a look at the few such rows (none once rebuilt), not a scan of every document.
CREATE INDEX documents_analysis_version ON documents (analysis_version, workspace) WHERE NOT deleted;
