-- The delta stream each durable consumer's index follows (services/projector/following.py). A stream lost and made
-- again, or restored from a backup older than the index, numbers new deltas with sequences the index has read: the
-- projector refuses it until an operator adopts it (`ontofabric adopt-stream`).
--   stream_created: when the stream the index reads was made, as JetStream reports it.
--   mark_seq, mark: a sequence the index has read, and a digest of the delta there.
--   refused: why the holder refuses the stream now; NULL while it follows it (`ontofabric status` shows it).
ALTER TABLE projection_fences
    ADD COLUMN stream_created timestamptz,
    ADD COLUMN mark_seq bigint,
    ADD COLUMN mark text,
    ADD COLUMN refused text;
