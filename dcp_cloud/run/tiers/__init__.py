"""Tiered checkpoints: a node-local tier, peer replicas over the process group, a drain to the object store."""
