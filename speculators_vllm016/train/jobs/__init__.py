"""One training job from its config: the config, the checks before the first step, the draft,
the ranks, the loaders, the run."""
