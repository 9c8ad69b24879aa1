-- A row whose keyword index a projector of an earlier release rewrote reads analysis 0 (0024 kept the label the
-- row had: after a downgrade and an upgrade, 180 rows of the earlier analysis were labelled current and `status`
-- counted 2 of them, an upgrade tester's). A projector of this release says, in every batch's transaction, which
-- analysis it writes (services/projector/store.py); an update that changes a document's search vector without
-- saying so is another release's. The condition is in the trigger's WHEN, so that this release's own writes never
-- call the function.
CREATE FUNCTION documents_analysis_of_another_writer() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    NEW.analysis_version := 0;
    RETURN NEW;
END
$$;
CREATE TRIGGER documents_analysis_of_another_writer
    BEFORE UPDATE ON documents FOR EACH ROW
    WHEN (current_setting('ontofabric.analysis_version', true) IS DISTINCT FROM NEW.analysis_version::text
          AND NEW.search_vector IS DISTINCT FROM OLD.search_vector)
    EXECUTE FUNCTION documents_analysis_of_another_writer();
