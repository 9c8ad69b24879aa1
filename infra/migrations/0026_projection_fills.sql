-- Whether the index behind a durable consumer is still to be filled from nothing. A database lost and replaced by
-- an empty one (or a new primary for a new partition layout) behind a consumer that had already delivered would
-- otherwise have gone on from the consumer's position and never held what came before; on a compacted stream it
-- needs the snapshots too, as a rebuild reads them. A claim that creates a consumer's row sets 'unknown'; the
-- claiming process then decides, once, by whether the index holds a version of any workspace of the consumer:
-- 'pending' for none (it restores the snapshots and reads the stream from its first delta, and may be stopped and
-- start again), 'done' otherwise and once filled. Rows from before this migration have been applying all along.
ALTER TABLE projection_fences ADD COLUMN fill text NOT NULL DEFAULT 'done'
    CHECK (fill IN ('unknown', 'pending', 'done'));
