"""In-memory snapshots (checkpoint.memory_interval): `manager` takes and publishes them, `file_format` writes and
checks one rank's file, `peers` picks the rank that keeps each replica, `restore` agrees on a step at a restart and
loads it."""
