-- A query on a branch hides main's chunks of each file the branch holds a chunk of, or deleted (services/query/
-- postgres.py _shadowed_ids): main's chunks of those files are found by their file, not read from the whole
-- partition. Declared on the parent, so every workspace partition, and a rebuild's shadow, gets one. On a large
-- existing index this build holds writes off the documents table for its duration.
CREATE INDEX IF NOT EXISTS documents_file_path ON documents (workspace, branch, file_path);
