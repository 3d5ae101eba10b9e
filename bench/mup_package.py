"""The `mup` package (Microsoft's reference implementation of µP) on torchpre's Llama, for `python -m bench.coord_check
--compare-mup`: the tiny model at each width made µP the package's way (its output layer a `MuReadout`, the attention
scale 1/head dim, `set_base_shapes` against the base width 64, hidden matrices initialised as `mup.init` does, trained
by `MuAdamW`), checked against torchpre's own µP model of the same width, and the package's coordinate check
(`mup.get_coord_data`) run on it.

The `mup` package is not a dependency: install it where this runs (`pip install --target DIR mup` and DIR on
PYTHONPATH).
"""

import tempfile
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn

from bench.common import print_table
from bench.one_batch import fixed_batch
from torchpre.assembly.args import model_args
from torchpre.assembly.parametrization import optimizer_scales
from torchpre.config.job_config import JobConfig
from torchpre.config.parser import parse_args
from torchpre.data.tokenizer import DEFAULT_TOKENIZER_PATH, load_tokenizer
from torchpre.models.llama3.model import Transformer

BASE = 64
SEED = 0


def _args(width: int, parametrization: str = "sp", seq_len: int = 64):
    flags = ["--model.flavor", "tiny", "--model.dim", str(width), "--model.parametrization", parametrization,
             "--training.seq_len", str(seq_len)]  # fmt: skip
    return model_args(parse_args(JobConfig, flags), load_tokenizer(DEFAULT_TOKENIZER_PATH))


def package_model(width: int, mup) -> Transformer:
    """The standard tiny model at `width` made µP by the package: MuReadout output, attention 1/head dim, base shapes
    from the base width (which rescales the MuReadout), matrix-like weights times width_mult^-1/2 as `mup.init`."""
    models = {}
    for dim in (BASE, width):
        model = Transformer(_args(dim))
        model.init_weights(SEED)
        head_dim = model.args.head_dim
        for block in model.layers.values():
            block.attention.query_multiplier = (BASE // 4 / head_dim) ** 0.5
        readout = mup.MuReadout(dim, model.args.vocab_size, bias=False)
        readout.weight.data.copy_(model.output.weight.data)
        model.output = readout
        models[dim] = model
    model = mup.set_base_shapes(models[width], models[BASE])
    with torch.no_grad():
        for param in model.parameters():
            if param.infshape.ninf() == 2:
                param.mul_(param.infshape.width_mult() ** -0.5)
    return model


def compare_rules(width: int, mup) -> list[list[object]]:
    """Per parameter kind: the package's MuAdamW learning-rate and weight-decay factors and init std against
    torchpre's."""
    model = package_model(width, mup)
    optimizer = mup.MuAdamW(model.parameters(), lr=1.0, weight_decay=1.0)
    by_param = {id(p): (g["lr"], g["weight_decay"]) for g in optimizer.param_groups for p in g["params"]}
    ours_args = _args(width, "mup")
    ours = Transformer(ours_args)
    ours.init_weights(SEED)
    ours_params = dict(ours.named_parameters())
    factors = optimizer_scales(ours_args, "AdamW").factors
    rows = []
    for name, param in model.named_parameters():
        if not name.startswith(("layers.0.", "tok_", "output", "norm")):
            continue
        lr, decay = by_param[id(param)]
        our_lr, our_decay, _ = factors(name, tuple(param.shape))
        rows.append([name, f"{lr:.4g}", f"{our_lr:.4g}", f"{decay:.4g}", f"{our_decay:.4g}",
                     f"{param.std().item():.4g}", f"{ours_params[name].std().item():.4g}"])  # fmt: skip
        assert abs(lr - our_lr) < 1e-12 and abs(decay - our_decay) < 1e-12, name
        torch.testing.assert_close(param, ours_params[name], rtol=1e-5, atol=0, msg=name)
    return rows


def coordinate_check(widths: Sequence[int], steps: int, mup) -> None:
    """The package's own coordinate check (mean |activation| of each block and of the logits at each step, on one
    fixed batch, MuAdamW at lr 1e-3) on `package_model`."""
    from mup.coord_check import get_coord_data

    with tempfile.TemporaryDirectory() as folder:
        _, tokens, labels = fixed_batch(Path(folder))
    labels = labels.flatten()
    models = {width: (lambda width=width: _LogitsOnly(package_model(width, mup))) for width in widths}
    names = {"model.layers.0": "block 0", "model.layers.1": "block 1", "model.output": "logits"}
    data = get_coord_data(models, [(tokens, labels)], optimizer="adamw", lr=1e-3, nsteps=steps, flatten_output=True,
                          cuda=False, show_progress=False, filter_module_by_name=names.__contains__)  # fmt: skip
    for t in (1, steps):
        rows = []
        for module, label in names.items():
            values = [data[(data.module == module) & (data.t == t) & (data.width == w)].l1.item() for w in widths]
            rows.append([label, *(f"{v:.3g}" for v in values), f"{max(values) / min(values):.2f}"])
        print_table(f"the mup package's coordinate check: mean |x| at step {t}", ["coordinate", *map(str, widths),
                    "max / min"], rows)  # fmt: skip


class _LogitsOnly(nn.Module):
    """The model, returning its logits for the package's loss."""

    def __init__(self, model: Transformer) -> None:
        super().__init__()
        self.model = model

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model(tokens)


def compare(widths: Sequence[int], steps: int) -> None:
    import mup

    for width in widths[1:]:
        rows = compare_rules(width, mup)
        headers = ["parameter", "mup lr", "torchpre lr", "mup decay", "torchpre decay", "mup std", "torchpre std"]
        print_table(f"width {width} over {BASE}: MuAdamW and mup.init against torchpre (equal)", headers, rows)
    coordinate_check(widths, steps, mup)
