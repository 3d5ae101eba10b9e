"""The rules a training step follows, one table row or one small value each and no torch: the pipeline schedules
(`schedules.py`), the ZeRO stages (`zero_stages.py`), a step's batch sizes (`batch.py`) and the global-batch ramp
(`ramp.py`). The config (for --help and validation), the parallel machinery that builds them, the training loop and
the planner read the same rows."""
