-- ontology_status names a workspace's other branches that hold rows of their own (services/query/postgres.py,
-- branch_states): a branch taken back by `ontofabric delete-branch` keeps its rows only as transparent ones, which
-- the status passes over. Without these, telling the two apart read every transparent row of each branch, or the
-- whole partition (a review's: 47-52 ms a status at 1,200 branches). Branch rows only, so main's writes do not
-- maintain them; declared on the parent, so every workspace partition and a rebuild's shadow gets one.
CREATE INDEX IF NOT EXISTS documents_branch_own ON documents (workspace, branch)
    WHERE branch <> 'main' AND NOT transparent;
CREATE INDEX IF NOT EXISTS ontology_nodes_branch_own ON ontology_nodes (workspace, branch)
    WHERE branch <> 'main' AND NOT transparent;
CREATE INDEX IF NOT EXISTS ontology_links_branch_own ON ontology_links (workspace, branch)
    WHERE branch <> 'main' AND NOT transparent;
