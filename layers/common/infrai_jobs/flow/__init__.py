"""Flow control: retry policies, deferred work, rate limits and concurrency keys per job."""
