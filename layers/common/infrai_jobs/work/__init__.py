"""The one writer of ``job_claims``: its states and transitions, every statement on the table,
the lease rule, and the schema that holds them."""
