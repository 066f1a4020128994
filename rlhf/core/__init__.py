"""Layer 1, what every stage shares: the typed config and its loader, the stage registry and context,
the artifact store, model resolution, code hashing and the resource meters. Imports maths at most."""
