"""Prefect flows: a thin shell over rlhf.pipeline.runner. Nothing here computes; it schedules and logs."""
