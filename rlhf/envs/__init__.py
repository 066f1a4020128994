"""Environments for multi-turn episodes: the policy speaks, the environment answers, until it ends the
episode or a budget runs out (base.py the protocol, calculator.py the built-in tool, sandbox.py where an
environment runs, episodes.py the rollout loop)."""
