"""Benchmarks: programs that print measured tables (never timed tests)."""
