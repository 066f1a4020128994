"""Pipeline stages: plain Python, no Prefect. Each module has `run(stage_cfg, ctx) -> StageResult`."""
