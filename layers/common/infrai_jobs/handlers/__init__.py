"""The functions' entry points: each one's Handler, and the only importers of the jobs package."""

# Each builds what it needs on its first invocation and keeps it while the environment stays
# warm (functools.cache); a rotated API key or database secret is fetched again when the cached
# one fails (runtime.factory.with_secrets). A scheduled function's log lines carry its event's id
# (Scheduler's execution id) as their correlation id.
