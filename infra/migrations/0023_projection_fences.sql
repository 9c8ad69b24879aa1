-- Who applies each durable consumer of the stream, and since which claim: the fencing token of the process that
-- applies it. A process claims a consumer as it starts applying it (a new epoch) and renews its claim at every look
-- at the other projectors; every batch's transaction first renews its consumer's row (locking it) and writes nothing
-- when the epoch is no longer its own. Discovery decides which process should apply a consumer; this row decides
-- which one may: a process frozen with a batch in hand, replaced meanwhile, cannot commit it as it wakes (a review,
-- 2026-11-29), and a claim renewed within the lease is not taken over by a process that cannot see its holder in
-- discovery (services/projector/worker.py).
-- Epochs come from one sequence, so a row deleted and claimed again never repeats an epoch a frozen process holds.
CREATE SEQUENCE projection_fence_epochs;
CREATE TABLE projection_fences (
    durable text PRIMARY KEY,
    epoch bigint NOT NULL,
    holder text NOT NULL,
    claimed_at timestamptz NOT NULL DEFAULT now(),
    renewed_at timestamptz NOT NULL DEFAULT now(),
    -- Set by a holder that stopped applying the consumer (a SIGTERM, its seniority given up): a standby then takes
    -- it over at its next look rather than after the lease.
    released boolean NOT NULL DEFAULT false
);
