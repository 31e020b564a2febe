"""The functions' entry points: each one's Handler, and the only importers of the jobs package."""
