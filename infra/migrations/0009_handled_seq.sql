-- The highest stream sequence of each workspace's branch the projector has handled: applied, or found to change
-- nothing (a repeat, an older delta). Unlike stream_seq, a no-op moves it, so readers can tell "every delta up to
-- here is in" (_meta.freshness) without the ontologyVersion changing when nothing did.
ALTER TABLE ontology_versions ADD COLUMN handled_seq bigint NOT NULL DEFAULT 0;
UPDATE ontology_versions SET handled_seq = stream_seq;
