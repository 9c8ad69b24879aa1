-- Where the index behind each durable consumer stands, kept in the index itself. A database that goes back in
-- time under its consumers (a replica promoted without the last commits, a backup restored) no longer holds
-- deltas the consumer had acked: read on from the consumer's position, the index would never hold them.
--   position: the stream sequence through which the index held (or had settled without writing: dead-lettered,
--     another partition's) every delta of the consumer, as its holder last found the consumer's ack floor. A
--     claim that finds the consumer's floor past it reads the stream again from just after it. NULL: not known
--     (rows from before this migration, a claim's new row): the claim takes the consumer's floor.
--   commits: the batches its holders committed. A holder counts its own and writes only while the row agrees: a
--     row behind its count is a database that went back, and the holder claims the consumer again.
--   read_before: the highest floor the consumer had reached before it was last made to read again behind it. A
--     delta at or below it that no index can apply was dead-lettered then: it is not dead-lettered again.
ALTER TABLE projection_fences
    ADD COLUMN position bigint,
    ADD COLUMN commits bigint NOT NULL DEFAULT 0,
    ADD COLUMN read_before bigint NOT NULL DEFAULT 0;
