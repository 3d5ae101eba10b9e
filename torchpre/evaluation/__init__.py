"""Evaluation during training: the held-out loss (`validation`) and downstream multiple-choice tasks
(`multiple_choice`), each an evaluator built from the job's config and run under the training layout (`registry`)."""
