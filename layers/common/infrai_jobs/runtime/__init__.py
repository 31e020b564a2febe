"""Wiring for the functions and the CLI: the factory, the drain service, observability."""
