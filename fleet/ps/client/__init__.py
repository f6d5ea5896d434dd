"""The worker's connection to the parameter servers: sharded tables behind futures."""
