"""Which steps stay and how the others go: the rules (pure), the passes that uncommit and delete, and the
readers' leases that keep every pass away from a step being loaded."""
