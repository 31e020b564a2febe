"""The claim ledger in Postgres: claims, outcomes, its schema version and the one adapter."""
