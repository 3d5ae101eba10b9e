"""User-facing errors.

A `TorchpreError` carries a message written for the person running the job: it names the key,
file or value at fault and says what to change. Entry points print it as one paragraph and exit
non-zero instead of showing a traceback.
"""


class TorchpreError(Exception):
    """An error caused by the user's input (config, files, layout), not by a bug."""


class ConfigError(TorchpreError):
    """A config key is unknown, has the wrong type, or holds an impossible value."""
