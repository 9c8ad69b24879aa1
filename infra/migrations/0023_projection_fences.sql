-- Who applies each durable consumer of the stream, and since which claim: the fencing token of the process that
-- applies it. A process claims a consumer as it starts applying it (the epoch goes up by one), and every batch's
-- transaction first reads its consumer's row (FOR SHARE) and writes nothing when the epoch is no longer its own.
-- Discovery and the lease (services/projector/worker.py) decide who applies; this makes a process that lost the
-- consumer while frozen with a batch in hand unable to commit it beside the one that took over (a review,
-- 2026-11-29: the batch in hand at a freeze was committed as the process woke).
CREATE TABLE projection_fences (
    durable text PRIMARY KEY,
    epoch bigint NOT NULL,
    holder text NOT NULL,
    claimed_at timestamptz NOT NULL DEFAULT now(),
    -- Set by a holder that stopped applying the consumer (a SIGTERM, standing by): a standby then takes it over
    -- at its next look rather than after the discovery lease.
    released boolean NOT NULL DEFAULT false
);
