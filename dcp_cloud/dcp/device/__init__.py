"""Device staging: pinned host memory (the ``async_save`` pool and its ledger), the rings that move bytes
between device and host, and the device paths of saves (feeding) and loads (landing)."""
