"""One training job from its config: the config, the checks before the first step, the run."""
