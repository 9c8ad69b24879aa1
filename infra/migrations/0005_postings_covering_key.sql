-- Postings scoring reads tf and doc_length for every posting of a query term: carried in the primary key's index,
-- the read is index-only once vacuum has marked the pages all-visible, instead of one heap fetch per posting.
ALTER TABLE postings DROP CONSTRAINT postings_pkey;
ALTER TABLE postings ADD PRIMARY KEY (workspace, branch, term, doc_id) INCLUDE (tf, doc_length);
