"""The on-store contract of a checkpoint: keys and metadata extras, index footers, checksums, content
hashes, torch.save framing and serialization, zstd items, the create-only commit, and the private torch
names all of them rely on. Everything that reads or writes checkpoints builds on it; it builds on
``store/``, ``transfer/``, ``errors``, ``config`` and ``uri`` only."""
