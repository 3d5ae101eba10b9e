"""Model families: plain PyTorch models and their specs, looked up by `model.name` in `torchpre.models.registry`.

Importing any part of this package registers the built-in families (`torchpre.models.families`).
"""

from torchpre.models import families  # noqa: F401
