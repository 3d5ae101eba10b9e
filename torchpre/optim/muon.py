"""Muon for the hidden matrices, AdamW for the rest (embeddings, the output layer, norms, biases), as the
practitioners' hybrid (Keller Jordan's Muon; Moonlight's scaling).

Muon keeps a momentum of each matrix's gradient (elementwise, so kept on this rank's shard like AdamW's moments)
and steps along its orthogonalisation: a Newton-Schulz iteration that needs the whole matrix. Under ZeRO, FSDP,
tensor or expert parallelism each rank holds shards only, so the orthogonalisation runs on whole matrices
assembled on one owner rank each (`whole_matrices.WholeMatrices`) and each rank takes back its shard of the result:
the update one process would make, on every layout. A MoE's experts (a stack of matrices) are orthogonalised one
expert at a time, on a rank of their expert-parallel group.

`torch.optim.Muon` is the reference for the single-matrix math (same iteration, coefficients and learning-rate
adjustments); it takes 2-D parameters only, always iterates in bf16, and sees whatever shard it is given.
"""

import fnmatch
import math
from collections.abc import Callable, Sequence

import torch
from torch.distributed.tensor import DTensor

from torchpre.errors import ConfigError
from torchpre.optim.whole_matrices import WholeMatrices

# Keller Jordan's quintic coefficients (torch.optim.Muon's defaults) and the norm floor torch uses.
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_EPS = 1e-7
LR_ADJUSTMENTS = ("match_rms_adamw", "original", "spectral_unclamped", "none")
NS_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def orthogonalize(
    matrices: torch.Tensor, coefficients: Sequence[float] = NS_COEFFICIENTS, steps: int = 5,
    dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:  # fmt: skip
    """The Newton-Schulz approximation of U Vᵀ (U S Vᵀ = the matrix) of each matrix in the last two dimensions of
    `matrices`, iterated in `dtype` and returned in the input's dtype. For one matrix in bf16 this is
    torch.optim.Muon's `_zeropower_via_newtonschulz`, operation for operation."""
    a, b, c = coefficients
    shape = matrices.shape
    x = matrices.to(dtype).reshape(-1, *shape[-2:]) if matrices.ndim > 2 else matrices.to(dtype)
    tall = x.size(-2) > x.size(-1)
    if tall:
        x = x.mT
    x = x / x.norm(dim=(-2, -1), keepdim=True).clamp(min=NS_EPS)
    addmm = torch.addmm if x.ndim == 2 else torch.baddbmm
    for _ in range(steps):
        gram = x @ x.mT
        x = addmm(x, addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    if tall:
        x = x.mT
    return x.reshape(shape).to(matrices.dtype)


def lr_scale(shape: Sequence[int], adjust: str) -> float:
    """The factor on the learning rate of a matrix of `shape` (its last two dimensions, rows × columns):
    "match_rms_adamw" gives the update AdamW's RMS (0.2·√max(rows, cols), Moonlight), so AdamW's learning rate
    and weight decay carry over; the others are torch.optim.Muon's `adjust_lr_fn` choices."""
    rows, cols = shape[-2:]
    return {
        "match_rms_adamw": 0.2 * math.sqrt(max(rows, cols)),
        "original": math.sqrt(max(1.0, rows / cols)),
        "spectral_unclamped": math.sqrt(rows / cols),
        "none": 1.0,
    }[adjust]


def check_settings(values: dict[str, object]) -> None:
    """Muon's `optimizer.muon_*` values, before any work."""
    problems = []
    if not 0.0 <= float(values["muon_momentum"]) < 1.0:
        problems.append(f"optimizer.muon_momentum = {values['muon_momentum']} must be in [0, 1)")
    if not 1 <= int(values["muon_ns_steps"]) < 100:
        problems.append(f"optimizer.muon_ns_steps = {values['muon_ns_steps']} must be between 1 and 99")
    if len(values["muon_ns_coefficients"]) != 3:
        problems.append(f"optimizer.muon_ns_coefficients = {values['muon_ns_coefficients']} needs 3 values (a, b, c)")
    for key, choices in (("muon_ns_dtype", NS_DTYPES), ("muon_lr_adjust", LR_ADJUSTMENTS)):
        if values[key] not in choices:
            problems.append(f"optimizer.{key} = {values[key]!r}: use one of {', '.join(choices)}")
    if problems:
        raise ConfigError("; ".join(problems) + ".")


def hidden_matrices(named_params: Sequence[tuple[str, torch.Tensor]], vocab_size: int, adamw_params: Sequence[str],
                    embeddings: set[str]) -> set[str]:  # fmt: skip
    """The names Muon steps: parameters with two or more dimensions that are not an embedding (`embeddings`: the
    parameters of `nn.Embedding` modules), have no dimension of the vocabulary's size (the output layer, tied or
    not) and match none of the `adamw_params` patterns (fnmatch, `optimizer.muon_adamw_params`)."""
    return {
        name for name, param in named_params
        if param.ndim >= 2 and name not in embeddings and vocab_size not in param.shape
        and not any(fnmatch.fnmatchcase(name, pattern) for pattern in adamw_params)
    }  # fmt: skip


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


class Muon(torch.optim.Optimizer):
    """Muon on the parameters named in `hidden`, AdamW (torch's, with `betas` and `eps`) on the others, over the
    param groups of `torchpre.optim.DistributedOptimizer` (each with "names" and, since this class assembles whole
    matrices, "layouts": the DTensor each master is a shard of).

    One learning rate for both (the LR schedule's); Muon's is scaled per matrix by `lr_scale(muon_lr_adjust)`.
    Weight decay is decoupled for both (`p ← p·(1 − lr·wd)`), on the matrices only. Nesterov momentum as torch's:
    `buf ← lerp(buf, g, 1 − μ)`, update `lerp(g, buf, μ)`. `foreach` is AdamW's (`optimizer.implementation`).
    """

    def __init__(
        self,
        param_groups: list[dict],
        *,
        hidden: set[str],
        lr: float,
        betas: tuple[float, float],
        eps: float,
        muon_momentum: float,
        muon_nesterov: bool,
        muon_ns_steps: int,
        muon_ns_coefficients: Sequence[float],
        muon_ns_dtype: str,
        muon_lr_adjust: str,
        foreach: bool | None = None,
    ):
        # Muon's group first, then AdamW's part of each given group, empty ones kept: every pipeline stage has the
        # same groups (some without embeddings or without hidden matrices), so LR-schedule state reloads anywhere.
        decay = next((g["weight_decay"] for g in param_groups if any(p.ndim >= 2 for p in g["params"])), 0.0)
        muon: dict = {"params": [], "names": [], "layouts": [], "weight_decay": decay}  # the matrices' decay
        split: list[dict] = []
        for group in param_groups:
            chosen = [name in hidden for name in group["names"]]
            for key in ("params", "names", "layouts"):
                muon[key] += [value for value, take in zip(group[key], chosen) if take]
            split.append({"params": [p for p, take in zip(group["params"], chosen) if not take],
                          "names": [n for n, take in zip(group["names"], chosen) if not take],
                          "weight_decay": group["weight_decay"], "muon": False})  # fmt: skip
        muon_layouts = muon.pop("layouts")
        split.insert(0, {**muon, "muon": True})
        defaults = {"lr": lr, "momentum": muon_momentum, "nesterov": muon_nesterov}
        super().__init__(split, defaults)
        self.muon_group = self.param_groups[0]
        self.adamw = torch.optim.AdamW(self.param_groups[1:], lr=lr, betas=betas, eps=eps, foreach=foreach)
        self.adamw.state = self.state  # one state mapping: checkpoints read every master's entry from here
        self.layouts = muon_layouts
        device = next(p.device for group in param_groups for p in group["params"])
        self.whole = WholeMatrices(muon_layouts, device)
        self._orthogonalize: Callable[[torch.Tensor], torch.Tensor] = lambda m: orthogonalize(
            m, muon_ns_coefficients, muon_ns_steps, NS_DTYPES[muon_ns_dtype]
        )
        self.lr_adjust = muon_lr_adjust

    @property
    def sent_bytes(self) -> int:
        """Bytes this rank sent to assemble and return whole matrices in the last step."""
        return self.whole.sent_bytes

    @torch.no_grad()
    def step(self, closure: None = None) -> None:
        self.adamw.step()
        group = self.muon_group
        momentum, lr, decay = group["momentum"], group["lr"], group["weight_decay"]
        updates = []
        for param in group["params"]:
            grad = _local(param.grad)
            state = self.state[param]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(param.grad)
            buffer = _local(state["momentum_buffer"])
            buffer.lerp_(grad, 1 - momentum)
            updates.append(grad.lerp(buffer, momentum) if group["nesterov"] else buffer)
        for param, update, layout in zip(group["params"], self.whole.apply(self._orthogonalize, updates), self.layouts):
            local = _local(param)
            local.mul_(1 - lr * decay)
            local.add_(update, alpha=-lr * lr_scale(layout.shape, self.lr_adjust))

    @torch.no_grad()
    def initialise_state(self) -> None:
        """The state before the first step, without assembling any matrix (no collective): the momentum buffers at 0,
        which is where a zero gradient leaves them, and AdamW's state from its own step (on the zero gradients and
        zero learning rate `DistributedOptimizer._initialise_state` sets)."""
        self.adamw.step()
        for param in self.muon_group["params"]:
            self.state[param].setdefault("momentum_buffer", torch.zeros_like(param))
