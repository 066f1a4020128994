"""Layer 3, generation and scoring: the HF and vLLM rollout engines, log-probs, held-out accuracy."""
