"""What operators and the watcher do: claims admin, dead letters, redrive, reconcile, alerts."""
