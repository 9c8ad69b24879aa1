-- Event ids are unique within a workspace, not across workspaces: keyed on the id alone, a delta of one tenant
-- whose id another tenant had used was taken for a repeat and dropped without a trace. Rows handled before this
-- migration do not say their workspace: they keep '' and still count as handled in every workspace, so an old
-- event republished after the upgrade stays a no-op (services/projector/store.py reads them so). The default
-- stays '': a projector of the previous release, still running while a new one migrates, writes rows without a
-- workspace and keeps the old, global rule for them instead of failing every delta on NOT NULL.
-- Rebuilding the primary key locks the table (and so projection) while it runs: seconds per million rows.
ALTER TABLE handled_events ADD COLUMN workspace text NOT NULL DEFAULT '';
ALTER TABLE handled_events DROP CONSTRAINT handled_events_pkey;
ALTER TABLE handled_events ADD PRIMARY KEY (workspace, event_id);
