-- Keep each document's vector in its row. pgvector stores vectors EXTERNAL, so a row past the 2 kB TOAST threshold
-- (token signs, content and a 1.5 kB vector(384) together usually are) could have its vector moved to the TOAST
-- table: exact search then read every vector from there (about three buffer reads a row), and the planner, which
-- does not count that, chose exact search over HNSW for workspaces of thousands of documents (cosqa-dev's 6,267:
-- 15.6 ms where HNSW takes 1.0). MAIN moves the other columns out first; a vector leaves the row only when the row
-- still cannot fit in a page (vectors of thousands of dimensions). A catalog change, recursing to every workspace
-- partition (and inherited by partitions created later). A vector stored before it moves inline only when its row is
-- written with a new vector; `VACUUM FULL` on a workspace's partition moves them all (it locks the partition).
ALTER TABLE documents ALTER COLUMN embedding SET STORAGE MAIN;
