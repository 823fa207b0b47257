"""Resumable stage runs: the datagen -> vocabulary maps -> training chain and the runner under it.

`runner` runs typed stages in order and reruns only what is missing or whose inputs changed;
`ledgers` are the places a stage's record lives (one state file, a done file beside the output,
or the output itself); `gen_and_train` is the chain `speculators gen-and-train` runs. The demo
defines its own stages on the same runner. This layer sits above `evaluate` (a chain may end in an
evaluation) and below `cli`, which only parses a command line into a plan.
"""
