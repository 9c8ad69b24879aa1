-- An embedding model change (`ontofabric reembed`): the model the index is moving to while its documents are
-- embedded again beside their current vectors (the columns documents.embedding_next and its companions, which the
-- change adds with the new model's dimension and renames over the current ones when it swaps), and when the index
-- last changed model. The deployment row names the model the live vectors were made by, always.
-- previous_embedding_models: the models the index held before, whose deltas (the stream keeps them) projectors and
-- rebuilds embed again by the current one rather than refuse.
ALTER TABLE deployment
    ADD COLUMN next_embedding_model      text,
    ADD COLUMN next_embedding_dim        integer,
    ADD COLUMN model_changed_at          timestamptz,
    ADD COLUMN previous_embedding_models text[] NOT NULL DEFAULT '{}';
