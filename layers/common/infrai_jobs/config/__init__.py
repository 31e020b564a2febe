"""Settings, each declared once and read once from the environment; rotated secrets."""
