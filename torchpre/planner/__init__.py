"""Planning a run before it runs: per-rank memory from the dry run's code, step time from an explicit model
(`time_model`), machine profiles measured by `calibrate`, and the layout search of `python -m torchpre.plan`."""
