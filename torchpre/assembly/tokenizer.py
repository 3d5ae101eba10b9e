"""The job's tokenizer: the one model.tokenizer_path names, or the released model's own."""

from pathlib import Path

from torchpre.config.job_config import JobConfig
from torchpre.confined import file_kind, located
from torchpre.data.hf_tokenizer import TOKENIZER_JSON
from torchpre.data.tokenizer import DEFAULT_TOKENIZER_PATH, Tokenizer, load_tokenizer
from torchpre.interchange.reader import is_hf_folder


def tokenizer_path(config: JobConfig) -> Path:
    """model.tokenizer_path; when empty, the Hugging Face folder's own tokenizer (its tokenizer.json) when
    checkpoint.initial_load_path is a folder that has one (the model it releases is trained on with the ids it was
    made with), else the shipped tiktoken file."""
    if config.model.tokenizer_path:
        return Path(config.model.tokenizer_path)
    folder = Path(config.checkpoint.initial_load_path)
    if config.checkpoint.initial_load_path and is_hf_folder(folder):
        if file_kind(*located(folder, TOKENIZER_JSON)) != "missing":  # a link: read_files refuses it by name
            return folder
    return DEFAULT_TOKENIZER_PATH


def job_tokenizer(config: JobConfig) -> Tokenizer:
    """The job's tokenizer (`tokenizer_path`)."""
    return load_tokenizer(tokenizer_path(config))
