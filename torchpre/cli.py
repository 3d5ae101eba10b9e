"""What every entry point shares: logging per rank, --help, and bad input as one paragraph."""

import json
import logging
import os
import sys
import time
from collections.abc import Callable

from torchpre.errors import TorchpreError

EXIT_BAD_INPUT = 2


def configure_logging() -> None:
    """Rank 0 logs progress to stdout; other ranks only warnings, so the log reads as one job."""
    rank = int(os.environ.get("RANK", "0"))
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format=f"[rank{rank}] %(asctime)s %(message)s",
        datefmt="%H:%M:%S",
        stream=sys.stdout,
    )


def run_entry_point(main: Callable[[list[str]], None], argv: list[str], prog: str) -> None:
    """Runs `main(argv)`; prints help or a TorchpreError's message instead of a traceback."""
    from torchpre.config.job_config import JobConfig
    from torchpre.config.parser import HelpRequested, format_help
    from torchpre.distributed.utils import shutdown_distributed

    configure_logging()
    try:
        main(argv)
    except HelpRequested:
        print(format_help(JobConfig, prog))
        return
    except TorchpreError as error:
        rank = os.environ.get("RANK", "0")
        print(f"error (rank {rank}): {error}", file=sys.stderr, flush=True)
        _report_to_torchrun(str(error))
        sys.exit(EXIT_BAD_INPUT)
    shutdown_distributed()


def _report_to_torchrun(message: str) -> None:
    """Puts the message in torchrun's failure summary instead of its 'traceback: N/A'."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    extra = {"py_callstack": message, "timestamp": str(int(time.time()))}
    record = {"message": {"message": message, "extraInfo": extra}}
    with open(path, "w", encoding="utf-8") as file:
        json.dump(record, file)
