"""The one writer of ``job_claims``: its states, transitions, statements and lease rule."""
