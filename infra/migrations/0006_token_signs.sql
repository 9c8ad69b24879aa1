-- Late interaction: the sign bits of each document's token vectors (see contracts TokenVectors), read by the query
-- worker for the leading fused candidates only, so they need no index. Nullable: documents projected before this
-- migration, or sent without token vectors, are ranked as fused. Adding a nullable column rewrites no rows.
ALTER TABLE documents ADD COLUMN token_signs bytea;
