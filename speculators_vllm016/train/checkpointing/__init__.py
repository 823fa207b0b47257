"""The files of a checkpoint: their names, the RNG state and the lock that keeps saves whole."""
