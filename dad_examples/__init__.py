"""Example and benchmark data for dad-integrations (not part of the algorithm)."""
