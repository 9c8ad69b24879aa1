-- Second vectors: each document's vector from a second embedding model (float16 bytes, contracts SecondVector)
-- and that model's name, read by the query worker for its leading candidates only (the second opinion), so they
-- need no index. Nullable: documents projected before this migration, or sent without one, keep their place.
-- Adding nullable columns rewrites no rows.
ALTER TABLE documents ADD COLUMN IF NOT EXISTS second_vector bytea, ADD COLUMN IF NOT EXISTS second_model text;
