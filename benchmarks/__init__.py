"""Benchmarks of dAD against other gradient-compression schemes (see benchmarks/README.md)."""
