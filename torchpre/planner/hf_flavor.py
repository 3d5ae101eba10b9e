"""A released Hugging Face folder planned like a flavor.

`model.flavor = 'from_hf'` builds the model from the config.json at `checkpoint.initial_load_path`. The planner
measures a model by cutting its flavor to fewer blocks (`stage_costs.shortened_flavor`), so for the search the folder's
args are registered as a flavor of their family, under a name that says where they came from. Only config.json is
read (through the reader a job loads the folder with, `interchange.load.folder_args`: confined, bounded, every field
checked), so a model can be planned before its weights are downloaded: which boxes of them each rank reads does not
change a layout's step.
"""

import contextlib
import copy
from collections.abc import Iterator
from pathlib import Path

from torchpre.assembly.args import folder_vocab_size
from torchpre.assembly.tokenizer import tokenizer_path
from torchpre.config.job_config import JobConfig
from torchpre.confined import file_kind
from torchpre.errors import ConfigError
from torchpre.interchange.load import FROM_HF, folder_args
from torchpre.interchange.reader import CONFIG
from torchpre.models.registry import get_model_spec
from torchpre.planner.layout_space import cached_tokenizer


@contextlib.contextmanager
def planned_flavor(config: JobConfig) -> Iterator[JobConfig]:
    """`config` itself, or with `model.flavor = 'from_hf'` a copy whose flavor is the folder's args, registered for
    as long as the planning runs (forked workers inherit it), with the folder's vocabulary and no weights to load.
    The refusals of a run come first, worded as train.py words them: a field the family cannot honour, a shape
    key, a tokenizer larger than the embedding."""
    if config.model.flavor != FROM_HF:
        yield config
        return
    path = Path(config.checkpoint.initial_load_path)
    if not config.checkpoint.initial_load_path or file_kind(path, CONFIG) == "missing":  # a link: refused by name
        given = f"'{path}', which has none" if config.checkpoint.initial_load_path else "unset"
        raise ConfigError(
            f"model.flavor = '{FROM_HF}' plans the model of the config.json in the Hugging Face folder at "
            f"checkpoint.initial_load_path, which is {given}. Set it to the folder: its config.json is all the planner "
            "reads."
        )
    args = folder_args(path, get_model_spec(config.model.name), config.model.name)
    tokenizer = tokenizer_path(config)  # the folder's own, if it has one: pinned, as its path is planned without it
    vocabulary = folder_vocab_size(config, cached_tokenizer(tokenizer), args)
    flavors = get_model_spec(config.model.name).flavors
    name = f"{FROM_HF}:{path.resolve().name}"
    planned = copy.deepcopy(config)
    planned.model.flavor, planned.model.vocab_size, planned.model.tokenizer_path = name, vocabulary, str(tokenizer)
    planned.checkpoint.initial_load_path = ""
    flavors[name] = args
    try:
        yield planned
    finally:
        del flavors[name]
