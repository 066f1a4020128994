"""docs/configuration.md is generated from the config models and must not drift from them."""

from __future__ import annotations

from conftest import REPO
from rlhf.core.config import PipelineConfig
from rlhf.ops.config_docs import render


def test_configuration_doc_is_current():
    committed = (REPO / "docs" / "configuration.md").read_text()
    assert committed == render(), "docs/configuration.md is stale: python -m rlhf.ops.config_docs > docs/configuration.md"


def test_every_key_is_documented_with_a_meaning():
    lines = [line for line in render().splitlines() if line.startswith("| `")]
    keys = {line.split("`")[1] for line in lines}
    for section in ("sft", "kto", "grpo", "eval"):
        assert section in PipelineConfig.model_fields
    assert {"sft.lora.r", "ppo.kl.target", "kto.desirable_weight", "storage.attempts", "model.tiny.num_layers"} <= keys
    undocumented = [line.split("`")[1] for line in lines if line.rstrip().endswith("|  |")]
    assert not undocumented, f"fields without a comment in rlhf/core/config.py: {undocumented}"
