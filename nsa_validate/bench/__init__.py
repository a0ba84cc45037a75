"""Benchmarks as plain functions returning typed rows (the suites parametrise and assert)."""
