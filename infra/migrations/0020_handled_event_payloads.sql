-- A copy of an event (its id stored again past JetStream's duplicate window) carries the same change. Another
-- payload under an id already handled is not a copy: its producer reused the id, and the projector dead-letters it
-- (event_id_reused) where it used to drop it as a repeat without a trace. For that it keeps a digest of what each
-- handled event changed (services/projector/planning.py, payload_digest). Events handled before this migration
-- have none: a later delta under one of their ids stays a no-op.
ALTER TABLE handled_events ADD COLUMN payload_digest text;
