-- When each consumer's index position last moved forward, by the database's clock (not when it was claimed: where
-- every process's writes fail, holders hand the consumer over every 30 s, and a claim starting the clock again hid
-- the stall; a review's): `ontofabric status` names a consumer whose position has stood still for a minute while deltas
-- wait (its projector up, and its writes failing or hung). The consumer's own last ack could not tell: a
-- partition's consumer acks the other partitions' deltas as it passes them, however its own writes fare.
ALTER TABLE projection_fences ADD COLUMN advanced_at timestamptz NOT NULL DEFAULT now();
