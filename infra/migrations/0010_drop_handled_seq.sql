-- Freshness is now the Postgres projector's consumer ack floor, read from JetStream (services/query/freshness.py):
-- a branch's highest handled sequence could pass a delta still waiting for a retry, so it is no longer kept.
ALTER TABLE ontology_versions DROP COLUMN handled_seq;
