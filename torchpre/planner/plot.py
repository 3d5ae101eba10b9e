"""`python -m torchpre.plan ... --plot plan.png`: why the best layouts win, at a glance.

Left: each layout's busiest rank's memory stacked by part (parameters, gradients, optimizer state, activations)
against the GPU's usable memory. Right: its predicted step time split into compute, exposed communication
(tensor, expert, pipeline and the data-parallel part backward does not hide), pipeline bubble and optimizer.
"""

from pathlib import Path

from torchpre.optional import import_optional
from torchpre.planner.search import SearchResult

GiB = 2**30
MEMORY_PARTS = ("param_bytes", "grad_bytes", "optimizer_state_bytes", "activation_bytes")
MEMORY_LABELS = ("parameters", "gradients", "optimizer state", "activations")


def plot_layouts(result: SearchResult, top: int, path: Path) -> None:
    """Draws the `top` fastest fitting layouts (or, when none fits, the `top` smallest) into `path`."""
    import_optional("matplotlib", "python -m torchpre.plan --plot")
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    shown = (result.fitting or result.predictions)[:top]
    names = [p.checked.layout.describe() for p in shown]
    figure = Figure(figsize=(14, 1.2 + 0.55 * len(shown)))
    FigureCanvasAgg(figure)
    memory, time = figure.subplots(1, 2, sharey=True)
    positions = list(range(len(shown)))[::-1]
    left = [0.0] * len(shown)
    for part, label in zip(MEMORY_PARTS, MEMORY_LABELS):
        values = [getattr(p.peak, part) / GiB for p in shown]
        memory.barh(positions, values, left=left, label=label)
        left = [a + b for a, b in zip(left, values)]
    memory.scatter([p.reserved_bytes / GiB for p in shown], positions, marker="|", s=300, color="black",
                   label="allocator peak", zorder=3)
    usable = result.hardware.allocator_bytes / GiB
    memory.axvline(usable, color="black", linestyle="--", label=f"{result.hardware.name} for the allocator")
    memory.set_yticks(positions, names, fontsize=8)
    memory.set_xlabel("GiB on the busiest rank")
    memory.legend(fontsize=8, loc="lower right")
    steps = [p.step for p in shown]
    parts = {
        "compute": [s.compute_s if s else 0.0 for s in steps],
        "exposed communication": [
            s.tp_comm_s + s.ep_comm_s + s.pp_comm_s + s.dp_comm_exposed_s if s else 0.0 for s in steps
        ],
        "bubble": [s.bubble_s if s else 0.0 for s in steps],
        "optimizer": [s.optimizer_s if s else 0.0 for s in steps],
    }
    left = [0.0] * len(shown)
    for label, values in parts.items():
        time.barh(positions, values, left=left, label=label)
        left = [a + b for a, b in zip(left, values)]
    time.set_xlabel("predicted step time, s")
    time.legend(fontsize=8, loc="lower right")
    config = result.config
    figure.suptitle(
        f"{config.model.name} {config.model.flavor} on {result.gpus} x {result.hardware.name}, global batch "
        f"{config.training.global_batch_size} x {config.training.seq_len}"
    )
    figure.tight_layout()
    figure.savefig(path, dpi=110)
