"""Benchmarks: each script prints its figures and the ratio against open_clip_train (see BENCHMARKS.md)."""
