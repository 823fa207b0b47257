"""The files of a checkpoint: their names, the RNG state, the optimizer state by parameter name
and the lock that keeps saves whole."""
