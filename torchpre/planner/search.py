"""The planner's search: every valid layout, predicted, ranked; and its report as a table or JSON."""

from dataclasses import dataclass
from typing import Any

from torchpre.config.job_config import JobConfig
from torchpre.errors import ConfigError
from torchpre.planner.cost_cache import Measured
from torchpre.planner.hardware import Hardware
from torchpre.planner.layout_space import CheckedLayout, valid_layouts
from torchpre.planner.predict import Prediction, model_flops_per_token, predict
from torchpre.planner.progress import Progress
from torchpre.planner.time_model import assumptions
from torchpre.planner.workers import predict_in_workers

GiB = 2**30


@dataclass
class SearchResult:
    predictions: list[Prediction]  # best first: the fitting ones by tokens/s, then the rest by allocator peak
    rejected: int  # candidates start-up's checks refused
    hardware: Hardware
    gpus: int
    config: JobConfig

    @property
    def fitting(self) -> list[Prediction]:
        return [p for p in self.predictions if p.fits]

    def as_dict(self, top: int) -> dict[str, Any]:
        return {
            "model": f"{self.config.model.name} {self.config.model.flavor}",
            "gpus": self.gpus,
            "global_batch_size": self.config.training.global_batch_size,
            "seq_len": self.config.training.seq_len,
            "hardware": self.hardware.__dict__,
            "assumptions": assumptions(self.hardware),
            "valid_layouts": len(self.predictions),
            "rejected_layouts": self.rejected,
            "fitting_layouts": len(self.fitting),
            "layouts": [p.as_dict() for p in self.predictions],
        }

    def table(self, top: int) -> str:
        usable = self.hardware.allocator_bytes / GiB
        lines = [
            f"{self.config.model.name} {self.config.model.flavor} on {self.gpus} x {self.hardware.name} "
            f"({usable:.1f} GiB for the CUDA allocator), global batch {self.config.training.global_batch_size} x "
            f"{self.config.training.seq_len} tokens: {len(self.predictions)} valid layouts "
            f"({self.rejected} refused by start-up's checks), {len(self.fitting)} fit",
            "",
            f"{'layout':<58} {'mem GiB':>8} {'params':>7} {'grads':>7} {'optim':>7} {'activ':>7} "
            f"{'step s':>8} {'compute':>8} {'comm':>7} {'bubble':>7} {'tok/s':>10} {'MFU':>6}",
        ]
        lines += [_row(p) for p in self.fitting[:top]]
        others = [p for p in self.predictions if not p.fits][:top]
        if others:
            lines += ["", "closest to fitting among those that do not (the allocator's GiB needed per rank):"]
            lines += [_row(p) for p in others]
        return "\n".join(lines)


def _row(p: Prediction) -> str:
    peak, step = p.peak, p.step
    gib = [b / GiB for b in (p.reserved_bytes, peak.param_bytes, peak.grad_bytes, peak.optimizer_state_bytes,
                             peak.activation_bytes)]  # fmt: skip
    memory = f"{gib[0]:>8.1f} {gib[1]:>7.1f} {gib[2]:>7.1f} {gib[3]:>7.1f} {gib[4]:>7.1f}"
    if step is None:
        return f"{p.checked.layout.describe():<58} {memory} {'(model state alone does not fit)':>46}"
    comm = step.tp_comm_s + step.ep_comm_s + step.cp_comm_s + step.pp_comm_s + step.dp_comm_exposed_s
    return (
        f"{p.checked.layout.describe():<58} {memory} {step.total_s:>8.2f} {step.compute_s:>8.2f} {comm:>7.2f} "
        f"{step.bubble_s:>7.2f} {p.tokens_per_sec:>10,.0f} {p.mfu:>6.1%}"
    )


def search(
    config: JobConfig, hardware: Hardware, gpus: int, progress: bool = False, workers: int = 1
) -> SearchResult:
    """Predicts every layout start-up accepts and ranks them; a ConfigError naming the most common refusals when
    start-up accepts none. Context parallelism is searched too when sequences are long (`needs_context_parallel`).
    With `progress`, reports on stderr as it goes (`Progress`); with `workers` > 1, predicts in that many forked
    processes (`torchpre.planner.workers`)."""
    measured = Measured()
    checked, refusals = valid_layouts(config, gpus, hardware.gpus_per_node)
    predictions = _predict(checked, hardware, gpus, measured, "planner" if progress else "", workers)
    if needs_context_parallel(predictions):
        with_cp, cp_refusals = valid_layouts(config, gpus, hardware.gpus_per_node, context_parallel=True)
        checked, refusals = checked + with_cp, refusals + cp_refusals
        predictions += _predict(with_cp, hardware, gpus, measured, "planner, with cp" if progress else "", workers)
    rejected = sum(refusals.values())
    if not checked:
        reasons = " ".join(
            f"({i}) {count} of them: {message}" for i, (message, count) in enumerate(refusals.most_common(3), 1)
        )
        raise ConfigError(
            f"None of the {rejected} layouts of {config.model.name} {config.model.flavor} on {gpus} GPUs passes "
            f"start-up's checks. The most common refusals: {reasons}"
        )
    fits = sorted((p for p in predictions if p.fits), key=lambda p: -p.tokens_per_sec)
    rest = sorted((p for p in predictions if not p.fits), key=lambda p: p.reserved_bytes)
    return SearchResult(fits + rest, rejected, hardware, gpus, config)


def needs_context_parallel(predictions: list[Prediction]) -> bool:
    """Whether the sequences are long enough to search context parallelism: no layout without it fits unless it
    recomputes every block in backward (full activation checkpointing, about a third more compute). A cp rank holds
    a 1 / cp share of each sequence's activations, so cp layouts may fit with per-op checkpointing or none, at the
    price of a key/value gather per attention layer (the long-context recipes' choice: NeMo's Llama 3 8B at 128K
    runs cp8 on 64 GPUs). Otherwise cp is not searched: it only adds that gather, and a degree of it to every other
    layout to probe."""
    return not any(p.fits and p.checked.layout.activation_checkpoint != "full" for p in predictions)


def _predict(
    checked: list[CheckedLayout], hardware: Hardware, gpus: int, measured: Measured, label: str, workers: int = 1
) -> list[Prediction]:
    """Each layout predicted from `measured`'s pieces, in `workers` processes; progress reported under `label`
    (none when empty)."""
    if not checked:
        return []
    flops = model_flops_per_token(checked[0].config, checked[0].model_args)
    progress = Progress(label, len(checked)) if label else None

    def report(done: int, pieces: int) -> None:
        if progress:
            progress.update(done, pieces)

    if workers > 1:
        predictions = predict_in_workers(checked, hardware, gpus, flops, measured, workers, report)
    else:
        predictions = []
        for checked_layout in checked:
            predictions.append(predict(checked_layout, hardware, gpus, flops, measured))
            report(len(predictions), len(measured))
    if progress:
        progress.close()
    return predictions
