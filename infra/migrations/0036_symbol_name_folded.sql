-- Exact identifiers ignoring case in any script: PostgreSQL's lower() in the C locale the embedded server runs
-- lowers ASCII only, so a Unicode tester's İŞLEM found no İşlem (nor ПОЛЬЗОВАТЕЛЬ its пользователь). The name a
-- symbol is looked up by is now case-folded as the query worker folds names in Python (Unicode's full case folding
-- by PostgreSQL 18's casefold() and its builtin collation pg_unicode_fast, a dotted capital I as i;
-- services/query/postgres.py SYMBOL_NAME_SQL is the same expression, so that this index serves it). 0014's index
-- stays for this release: a query worker of the earlier one, beside these during an upgrade, looks names up by it
-- (without it, by reading the workspace's whole partition: a review's). Declared on the parent, so every workspace
-- partition, and a rebuild's shadow, gets one. On a large existing index this build holds writes off the
-- documents table for its duration.
CREATE INDEX IF NOT EXISTS documents_symbol_name_folded
    ON documents (workspace, (replace(casefold((regexp_replace(symbol_fqn, '^.*[.]', '')) COLLATE pg_unicode_fast),
                                      'i' || chr(775), 'i')));
