-- When each consumer's index position last moved forward (or was set back to be read again, or claimed), by the
-- database's clock: `ontofabric status` names a consumer whose position has stood still for a minute while deltas
-- wait (its projector up, and its writes failing or hung). The consumer's own last ack could not tell: a
-- partition's consumer acks the other partitions' deltas as it passes them, however its own writes fare.
ALTER TABLE projection_fences ADD COLUMN advanced_at timestamptz NOT NULL DEFAULT now();
