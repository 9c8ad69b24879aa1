-- Which analysis of the projector made each document's keyword index (services/projector/planning.py,
-- ANALYSIS_VERSION): a change to what it derives from a document (2026-11-30: a code symbol's own name weighed)
-- reaches only what is projected after it, so an index projected before is mixed until `ontofabric rebuild W`, and
-- nothing could tell. Rows written before this migration read 0, and so do rows a projector of an earlier release
-- inserts; one that overwrites a row keeps the row's version, so stop the earlier release's projectors before
-- reading the count. A constant default adds the column without rewriting the table: the lock it takes (every
-- read and write of documents waits) lasts a moment, and the index goes in a migration of its own (0025).
ALTER TABLE documents ADD COLUMN analysis_version smallint NOT NULL DEFAULT 0;
