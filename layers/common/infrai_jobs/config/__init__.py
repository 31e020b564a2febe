"""Settings read once from the environment, and fetching a rotated secret again."""
