"""Local-only tools (emulator, local invoke, demo, embedded Postgres helper); never deployed."""
