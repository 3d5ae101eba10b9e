"""The training loop and the components it sequences, each built from its config section."""
