"""Parameter-server training on a worker: the wrapped optimizer, its update modes and row backends."""
