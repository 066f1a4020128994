"""Layer 7, what users call: the CLI, Prefect services, reports, DuckDB queries, run diffs and config docs.
Only the CLI and services import Prefect or flows/."""
