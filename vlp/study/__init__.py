"""The loss comparison harness: grids, tuned studies, reports and statistics."""
