-- BM25 reads the postings (0002): no worker's query has read this index since, yet every projected document kept it
-- up. (The benchmarks' reference recipe reads one: they build it for their runs.)
-- At 100,000 documents it held 0.3 KB a document, and projection ran about 5 % faster without it
-- (docs/benchmarks.md, "Levers measured at 100,000 documents").
DROP INDEX IF EXISTS documents_search_gin;
