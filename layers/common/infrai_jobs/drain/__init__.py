"""The drain: batches consumed, claimed, run and settled, acks, and backlog fan-out."""
