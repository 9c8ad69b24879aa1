-- The text search configuration the keyword index was built with (tsvectors, postings, term statistics), recorded
-- by the first projector or migration that runs with it, and checked by every process as the embedding model is: a
-- query worker set up with another one found a document in 12 of 20 answers to the same query, by which worker
-- took it, without a word (a red team, 2026-11-29). Unset until then: a deployment migrated before records the
-- configuration of the first writer that starts after this migration.
ALTER TABLE deployment ADD COLUMN text_search_config text;
