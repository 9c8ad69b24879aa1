-- A query that is a file's path finds the file stored under a path ending with it (`guide.md` for `docs/guide.md`,
-- services/query/postgres.py PostgresDocuments.files) by the path read backwards, as a range of this index: the
-- condition on the path's end read every document of the workspace's partition (a review's: 65 ms at 150,000, on
-- every path not stored as asked, a made-up one or a frame of a file outside the index). In byte order ("C"), so
-- that a range of it is a prefix of the reversed path. Declared on the parent, so every workspace partition, and a
-- rebuild's shadow, gets one.
CREATE INDEX IF NOT EXISTS documents_file_path_reversed
    ON documents (workspace, branch, (reverse(file_path) COLLATE "C"));
