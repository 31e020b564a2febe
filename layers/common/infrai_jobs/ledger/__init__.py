"""The claim ledger in Postgres: claims, outcomes, migrations and the one connection adapter."""
