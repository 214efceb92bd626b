"""A run's tiers: a node-local copy of each step (:class:`~.config.LocalTier`), its replicas on peer nodes, its
drain to the run's root in the object store, and loads from the nearest complete copy (see the guide "Tiers:
node-local copies, peers and the object store")."""
