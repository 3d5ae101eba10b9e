"""Runtime services of a job: the world it runs in, entry-point plumbing, determinism, preemption, GC, profiling."""
