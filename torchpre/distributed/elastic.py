"""Elastic jobs (`torchrun --nnodes MIN:MAX`): which world sizes a layout can run on, and workers that die with their
torchrun agent.

torchrun re-forms the job whenever nodes leave or join, and the new workers resume the latest checkpoint under
`parallelism.data_parallel_degree = -1`: tp, pp and ep stay fixed and dp absorbs the change. Only some world sizes
fit those fixed degrees (and the global batch); the messages that reject the others name the ones that fit.
"""

import ctypes
import logging
import os
import signal
import sys

logger = logging.getLogger("torchpre")

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def usable_world_sizes(tp: int, pp: int, ep: int = 1, batch_rounds: int | None = None, count: int = 6) -> list[int]:
    """The smallest world sizes that dp = -1 can absorb with tp, pp and ep fixed: tp x pp x dp for every dp that ep
    divides and, when the global batch is fixed at `batch_rounds` local batches, that divides it. At most `count`."""
    if batch_rounds is None:
        degrees = [ep * k for k in range(1, count + 1)]
    else:
        degrees = [d for d in range(1, batch_rounds + 1) if batch_rounds % d == 0 and d % ep == 0]
    return [tp * pp * d for d in degrees[:count]]


def world_sizes_hint(tp: int, pp: int, ep: int = 1, batch_rounds: int | None = None, cp: int = 1) -> str:
    """One sentence naming the world sizes that fit, for the messages that stop a job launched on another one."""
    if batch_rounds is None:
        sizes = usable_world_sizes(tp * cp, pp, ep)
        degrees = {"tensor": tp, "pipeline": pp, "context": cp, "expert": ep}
        named = " x ".join(name for name, degree in degrees.items() if degree > 1)
        listed = ", ".join(map(str, sizes)) + f", ... (multiples of {sizes[0]}" + (
            f" = the {named} parallel degree{'s' if ' x ' in named else ''})" if named else ")"
        )
    else:  # every one: a number has few divisors
        sizes = usable_world_sizes(tp * cp, pp, ep, batch_rounds, count=batch_rounds)
        if not sizes:
            return (
                f"No world size can run it: its data-parallel degree must be a multiple of the expert parallel "
                f"degree {ep} that divides the global batch's {batch_rounds} local batches; change "
                "training.global_batch_size or training.local_batch_size."
            )
        listed = ", ".join(map(str, sizes))
    return (
        f"World sizes this job can run on: {listed}. Under torchrun --nnodes MIN:MAX, give each node a number of "
        "processes (--nproc-per-node) such that every node count from MIN to MAX gives one of them."
    )


def die_with_agent() -> None:
    """Asks Linux to SIGKILL this worker when its torchrun agent dies (a no-op elsewhere and outside torchrun).

    torchrun's workers outlive a killed agent: they train on with the other nodes, which therefore never see the node
    leave, and at the end the other agents wait out torchrun's 300 s exit barrier for the dead one. A worker that
    dies with its agent makes the loss of a node what it is on real hardware: the others' next collective fails and
    torchrun restarts them without it. (An agent that dies before this call, in the worker's first second, is not
    noticed: the parent pid alone cannot tell, as torchrun may itself be pid 1 in a container.)
    """
    if "TORCHELASTIC_RUN_ID" not in os.environ or not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG)")
    except (OSError, AttributeError) as error:
        logger.warning("cannot tie this worker's life to its torchrun agent's (%s)", error)
