"""Layer 4, training code the stages share: TRL Trainer plumbing, reward functions, the RL loop and the
reference log-prob cache. Stages under stages/ import from here; they never import each other."""
