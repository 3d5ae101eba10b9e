"""The layouts torchpre knows, one table row each and no torch: the pipeline schedules (`schedules.py`) and the ZeRO
stages (`zero_stages.py`), with what each needs and allows. The config (for --help and validation), the parallel
machinery that builds them and the planner read the same rows."""
