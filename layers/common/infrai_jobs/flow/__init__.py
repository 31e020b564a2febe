"""flow: retries beyond the queue's deliveries, rate limits and concurrency keys per job.

``policies`` reads what a job declares and what ``JOB_POLICIES`` overrides; ``ledger`` holds the
deferred work, the rate windows and the concurrency slots in the claim ledger's database. The
drain wires them in; nothing here runs a job.
"""
