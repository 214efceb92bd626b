"""What steps a run has: their names, one listing of the root classified, each step's record, rank 0's view of
the committed steps, and the run's description."""
