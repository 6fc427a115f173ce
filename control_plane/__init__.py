"""kvmesh control plane: the node registry and the Redis-backed global block map. See README.md here."""
