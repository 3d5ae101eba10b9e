"""What every entry point shares: logging per rank, --help, and bad input, a lost peer or a failed checkpoint write as
one paragraph."""

import json
import logging
import os
import re
import sys
import time
from collections.abc import Callable
from typing import NoReturn

from torchpre.errors import StorageError, TorchpreError

EXIT_BAD_INPUT = 2
EXIT_COMM_FAILURE = 3
EXIT_STORAGE_FAILURE = 4  # a checkpoint could not be written (full disk, no permission, I/O error)
# gloo reports a timed-out or broken connection as a plain RuntimeError; these mark its messages.
_GLOO_FAILURES = ("Timed out waiting", "Connection closed by peer", "Connection reset by peer", "gloo/transport")


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
    """Runs `main(argv)`; prints help, a TorchpreError's message (a StorageError's with its own exit code) or a lost
    peer's diagnosis instead of a traceback."""
    from torchpre.config.job_config import JobConfig
    from torchpre.config.parser import HelpRequested, format_help

    configure_logging()
    try:
        main(argv)
    except HelpRequested as request:
        print(format_help(request.config_cls or JobConfig, prog))
        return
    except TorchpreError as error:
        code = EXIT_STORAGE_FAILURE if isinstance(error, StorageError) else EXIT_BAD_INPUT
        _fail(str(error), code, wait_for_peers=_under_torchrun_with_peers())
    except RuntimeError as error:  # torch.distributed.DistError is one too
        if not _is_comm_failure(error):
            raise
        _fail(_comm_failure_message(error), EXIT_COMM_FAILURE)
    from torchpre.distributed.process_groups import shutdown_distributed  # loads torch, which `--help` does not need

    shutdown_distributed()


def _fail(message: str, code: int, wait_for_peers: bool = False) -> NoReturn:
    """One paragraph on stderr and in torchrun's summary, then a non-zero exit; with `wait_for_peers`, once every
    rank has failed too or passed the checks (`torchpre.distributed.peer_exit`)."""
    rank = os.environ.get("RANK", "0")
    # One write of the whole line (print writes the newline apart: with PYTHONUNBUFFERED, two system calls), so
    # that ranks sharing torchrun's stderr never interleave mid-line.
    sys.stderr.write(f"error (rank {rank}): {message}\n")
    sys.stderr.flush()
    _report_to_torchrun(message)
    if wait_for_peers:  # torchrun stops every worker once one exits: first let each print its own message
        import torch.distributed as dist

        from torchpre.distributed.peer_exit import wait_for_failed_peers

        wait_for_failed_peers(joined=dist.is_initialized())
    sys.exit(code)


def _under_torchrun_with_peers() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ and int(os.environ.get("WORLD_SIZE", "1")) > 1


def _is_comm_failure(error: RuntimeError) -> bool:
    """A collective or the rendezvous store gave up on a peer (not a bug of this rank)."""
    import torch.distributed as dist

    return isinstance(error, dist.DistError) or any(marker in str(error) for marker in _GLOO_FAILURES)


def _comm_failure_message(error: RuntimeError) -> str:
    """Names the likely cause and the key that bounds the wait, with the backend's own first line."""
    from torchpre.distributed.process_groups import comm_timeout, comm_timeout_key

    timeout, key = comm_timeout(), comm_timeout_key()
    limit = f"{timeout.total_seconds():g} s" if timeout else "its default"
    lines = str(error).strip().splitlines()
    detail = re.sub(r"^\[[^\]]*\]\s*", "", lines[0]) if lines else type(error).__name__  # drop gloo's [file:line]
    return (
        f"communication with the other ranks failed ({detail}). A peer process most likely died, hung "
        "(stopped, deadlocked, stuck in I/O) or lost its network; the first failure in the other ranks' output "
        f"or torchrun's summary says which. A rank waits for a silent peer {key} = {limit} before failing "
        "(comm.init_timeout_seconds until the first step is done, comm.timeout_seconds after); raise it if the ranks "
        "legitimately drift apart longer (a long first-step compile or checkpoint load, a slow checkpoint save)."
    )


def _report_to_torchrun(message: str) -> None:
    """Puts the message in torchrun's failure summary instead of its 'traceback: N/A'."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    extra = {"py_callstack": message, "timestamp": str(int(time.time()))}
    record = {"message": {"message": message, "extraInfo": extra}}
    with open(path, "w", encoding="utf-8") as file:
        json.dump(record, file)
