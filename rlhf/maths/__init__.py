"""Layer 0, pure maths: losses, advantages, KL estimators, Bradley-Terry. Imports nothing of ours."""
