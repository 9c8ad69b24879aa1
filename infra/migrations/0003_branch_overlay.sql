-- Branch overlay: a branch stores only its delta over main. Besides upserts and tombstones (which hide main's
-- row on the branch), a branch row can be transparent: the branch reverted its change, main shows through, and
-- the row only keeps the stream sequence that makes older deltas no-ops.

ALTER TABLE documents ADD COLUMN transparent boolean NOT NULL DEFAULT false;
ALTER TABLE ontology_nodes ADD COLUMN transparent boolean NOT NULL DEFAULT false;
ALTER TABLE ontology_links ADD COLUMN transparent boolean NOT NULL DEFAULT false;
