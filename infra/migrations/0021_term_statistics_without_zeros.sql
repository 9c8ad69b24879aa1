-- A term whose last document went now loses its row (services/projector/store.py, _DROP_POSTINGS), where 0016 kept
-- it at 0: with churn through new words the table grew with every word ever seen, not with the live corpus. The
-- rows left at 0 before this migration go now; the keyword retriever reads a missing row as a frequency of 0.
DELETE FROM term_statistics WHERE df <= 0;
