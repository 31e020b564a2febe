"""Writing jobs: the scaffold behind ``infrai-jobs new-job`` and its settings. Never deployed."""
