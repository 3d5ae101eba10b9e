"""bench.scaling in quick mode: real throughput numbers, the arithmetic of its table, equal losses."""

import math

import pytest

from bench import scaling

pytestmark = [pytest.mark.slow, pytest.mark.bench]

# Every layout sums the same per-token losses in a different order (fp32): ~1e-7 per step apart.
LOSS_ATOL = 1e-4


def parse_table(output: str) -> list[dict[str, str]]:
    """The rows of the first Markdown table in `output`, as {header: cell}."""
    lines = [line for line in output.splitlines() if line.startswith("|")]
    headers = [cell.strip() for cell in lines[0].strip("|").split("|")]
    return [dict(zip(headers, (cell.strip() for cell in line.strip("|").split("|")))) for line in lines[2:]]


def test_quick_scaling_table(capsys):
    results = scaling.main(["--quick"])["tiny"]
    rows = parse_table(capsys.readouterr().out)

    assert [row["layout"] for row in rows] == ["dp1", "dp2", "tp2", "pp2 (1F1B, 8 microbatches)"]
    reference = results[0].tokens_per_sec
    for row, result in zip(rows, results):
        assert math.isfinite(result.tokens_per_sec) and result.tokens_per_sec > 0
        assert 0 < result.cpu_share < 1.5  # one thread per process: about 1 at most
        assert float(row["tokens/s"].replace(",", "")) == pytest.approx(result.tokens_per_sec, abs=0.5)
        speedup = result.tokens_per_sec / reference
        nproc = int(row["processes"])
        assert nproc == result.layout.nproc
        assert float(row["speedup vs dp1"]) == pytest.approx(speedup, abs=0.005)
        assert float(row["efficiency"]) == pytest.approx(speedup / nproc, abs=0.005)

    dp1, dp2 = results[0].losses, results[1].losses
    assert len(dp1) == len(dp2) == scaling.QUICK.steps
    assert len(set(dp1)) > 1  # one loss per step, not one value repeated
    assert dp2 == pytest.approx(dp1, abs=LOSS_ATOL)
    for result in results[2:]:  # tensor and pipeline parallel are layout-invariant too
        assert result.losses == pytest.approx(dp1, abs=LOSS_ATOL), result.layout.name
    assert float(rows[1]["loss at last step"]) == pytest.approx(dp2[-1], abs=5e-5)
