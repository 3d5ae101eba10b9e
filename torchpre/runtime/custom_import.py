"""`job.custom_import`: the user's module, imported by every entry point before the job is checked, so
that what it registers (a model family, say) exists when the config names it."""

import importlib
import importlib.util
import os
import sys
from pathlib import Path

from torchpre.errors import ConfigError


def import_custom_module(name: str) -> None:
    """Imports `name`: a dotted module importable from the current folder, or a path to a .py file."""
    if not name:
        return
    if name.endswith(".py") or os.sep in name:
        _import_file(Path(name))
        return
    if os.getcwd() not in sys.path:  # `python -m torchpre.generate` and torchrun workers start elsewhere
        sys.path.insert(0, os.getcwd())
    try:
        importlib.import_module(name)
    except ModuleNotFoundError as error:
        if error.name is None or not name.startswith(error.name):
            raise  # the module itself imports something missing: its own traceback says what
        raise ConfigError(
            f"job.custom_import = '{name}': no module named '{error.name}' from {os.getcwd()}. Give a module "
            "importable from the current folder (e.g. examples.custom_model) or the path of a .py file."
        ) from None


def _import_file(path: Path) -> None:
    if not path.is_file():
        raise ConfigError(f"job.custom_import = '{path}': the file does not exist. Give a .py file or a module name.")
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module
    spec.loader.exec_module(module)
