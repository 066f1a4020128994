"""Layer 2, data: the embedded task (reasoning-gym), preference pairs, user data files, result schemas."""
