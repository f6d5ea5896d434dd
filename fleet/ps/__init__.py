"""The parameter server: protocol/ (the wire), server/ (the process), client/ (the worker's
connection) and worker/ (training on a worker: the optimizer and the update modes)."""
