-- Event ids are unique within a workspace, not across workspaces: keyed on the id alone, a delta of one tenant
-- whose id another tenant had used was taken for a repeat and dropped without a trace. Rows handled before this
-- migration do not say their workspace: they keep '' and still count as handled in every workspace, so an old
-- event republished after the upgrade stays a no-op (services/projector/store.py reads them so).
ALTER TABLE handled_events ADD COLUMN workspace text NOT NULL DEFAULT '';
ALTER TABLE handled_events ALTER COLUMN workspace DROP DEFAULT;
ALTER TABLE handled_events DROP CONSTRAINT handled_events_pkey;
ALTER TABLE handled_events ADD PRIMARY KEY (workspace, event_id);
