"""dcp_cloud inside code that never builds a writer or reader: the switch that routes ``dcp.save`` /
``dcp.load`` with a cloud ``checkpoint_id`` (:mod:`.routing`) and an fsspec filesystem on the stores
(:mod:`.filesystem`). Integrations with a framework's own seams go here, one module each."""
