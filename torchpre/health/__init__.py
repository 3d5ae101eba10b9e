"""Step health: the job-wide verdict on each step, what a non-finite step does (skip, stop, forensics), loss spikes."""
