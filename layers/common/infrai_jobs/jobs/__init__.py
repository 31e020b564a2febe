"""Declaring jobs: the registry, idempotency keys, payload schemas and reconcile probes."""
