"""Parameter and module names as the plain model spells them, whatever wraps it."""

# Module names that wrappers (activation checkpointing, torch.compile, FSDP) insert into FQNs.
_WRAPPER_NAMES = frozenset({"_checkpoint_wrapped_module", "_orig_mod", "_fsdp_wrapped_module"})


def canonical_fqn(fqn: str) -> str:
    """`fqn` without the names wrappers insert, so seeds and checkpoint keys do not depend on AC or compile."""
    return ".".join(part for part in fqn.split(".") if part not in _WRAPPER_NAMES)
