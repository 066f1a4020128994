"""Layer 6, running stages (stages/ is layer 5): the runner (skip/resume, manifests), the multi-process
launcher, preflight, memory estimates, the run lock and the supervisor. No Prefect."""
