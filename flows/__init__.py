"""Prefect flows: a thin shell over rlhf.runner. Nothing here computes; it schedules and logs."""
