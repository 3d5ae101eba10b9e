"""The job's model, assembled one way for training, validation, generation, conversion and the planner: its args
from the config and the tokenizer (args.py, with the shape, RoPE and parametrization keys), the checks that its
family can run the layout, the plain model on the meta device and the plans `torchpre.parallel.parallelize`
applies to it."""
