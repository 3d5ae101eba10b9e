"""bench/muon.py: the bytes Muon sends at dp2 ZeRO-1 are exactly the theory's (a number, not a timing), its FLOP
count is the three matmuls it names, and its quick mode prints every table (opt-in with -m bench: seven launches of
train.py, 2 to 3.5 minutes on 2 shared cores)."""

import pytest
import torch

from bench import muon


def tables(output: str) -> dict[str, list[dict[str, str]]]:
    """Each Markdown table printed by bench.common.print_table: its title's start -> rows as {header: cell}."""
    result = {}
    for section in output.split("\n### ")[1:]:
        title, *lines = section.splitlines()
        lines = [line for line in lines if line.startswith("|")]
        headers = [cell.strip() for cell in lines[0].strip("|").split("|")]
        rows = [dict(zip(headers, (cell.strip() for cell in line.strip("|").split("|")))) for line in lines[2:]]
        result[title.split(",")[0]] = rows
    return result


def test_newton_schulz_flops_count_the_three_matmuls_of_the_short_side():
    wide, tall = torch.Size([3, 5]), torch.Size([5, 3])
    one_step = 2 * 3 * 3 * 5 + 2 * 3 * 3 * 3 + 2 * 3 * 3 * 5
    assert muon.newton_schulz_flops([wide], steps=1) == muon.newton_schulz_flops([tall], steps=1) == one_step
    assert muon.newton_schulz_flops([torch.Size([4, 3, 5])], steps=5) == 4 * 5 * one_step  # a stack of experts


@pytest.mark.slow
@pytest.mark.bench  # CI checks the same bytes against the theory in tests/distributed/test_optimizers.py
def test_dp2_zero1_sends_exactly_the_theory():
    shapes = muon.hidden_shapes(muon.QUICK_TIMING.flavor)
    assert len(shapes) == 14  # 7 matrices in each of the tiny model's 2 layers
    theory = muon.sent_bytes_theory(shapes, group=2)
    assert theory == 2 * sum(shape.numel() for shape in shapes)  # half of every fp32 matrix, each way
    assert muon.measure_sent_bytes(muon.QUICK_TIMING, zero_stage=1) == theory


@pytest.mark.slow
@pytest.mark.bench
def test_quick_bench_prints_every_table(capsys, tmp_path):
    results = muon.main(["--quick", "--plot", str(tmp_path / "curves.png")])
    printed = tables(capsys.readouterr().out)

    steps = printed["Step time"]
    assert [(row["optimizer"], row["layout"]) for row in steps] == [
        ("AdamW", "1 process"), ("Muon", "1 process"), ("AdamW", "dp2 ZeRO-1"), ("Muon", "dp2 ZeRO-1"),
    ]  # fmt: skip
    assert all(float(row["step s (fastest)"]) > 0 for row in steps)
    assert [row["step vs AdamW"] for row in steps][::2] == ["1.00x", "1.00x"]
    (flops,) = printed["Newton-Schulz FLOPs per optimizer step (5 iterations; not in MFU)"]
    assert flops["hidden matrices"] == "14"
    sent = printed["Bytes one rank sends per step to assemble whole matrices"]
    assert [(row["layout"], row["measured / theory"]) for row in sent] == [
        ("dp2 ZeRO-1", "1.0000"), ("dp2 ZeRO-3", "1.0000"),
    ]  # fmt: skip
    assert results["sent_bytes"] == {"dp2 ZeRO-1": results["theory"], "dp2 ZeRO-3": results["theory"]}
    losses = printed["Final loss (mean of the last 20 of 20 steps)"]
    assert [(row["optimizer"], row["best"]) for row in losses] == [("AdamW", "best"), ("Muon", "best")]
    assert (tmp_path / "curves.png").stat().st_size > 0
