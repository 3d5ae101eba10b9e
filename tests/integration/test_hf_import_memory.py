"""Loading a Hugging Face folder costs each rank the memory of the shards it holds, not of the tensors or the model.

Each rank builds its share of the model under a layout (ZeRO-3: FSDP's dim-0 shards; tensor parallel: heads and
columns) in bf16, without an optimizer (tests/hf_load_memory.py), and loads a bf16 Llama folder into it through the
loader training uses. Every rank's peak RSS while loading (Linux's high-water mark, reset when the load starts)
must stay within 1.5 x the bytes it holds + 1 GiB, the bound the log reports. The CI-sized folder (188M
parameters, 378 MB) checks two sharper numbers, since its whole model fits in the bound's 1 GiB: the RSS the load
adds stays within 1.5 x held + 32 MiB (a rank that materialised its tensors whole would add the model's size), and
the bytes each rank reads equal the bytes it holds (the shards are head-aligned and stored in the dtype they load
in). `-m big_import` loads an 8B-shaped folder (16 GB) at 4 ranks: measured 3.74 GiB held and read per rank, peak
RSS 4.35-4.46 GiB under ZeRO-3 and 4.47-4.48 GiB under tp4 against the bound's 6.61 GiB (4 minutes in all).
"""

import json
from pathlib import Path

import pytest

from tests.hf_folders import CI_SIZED, LLAMA_8B, write_llama_folder
from tests.launch import run_train

pytestmark = pytest.mark.slow

GIB, MIB = 2**30, 2**20
LAYOUTS = {"zero3": ["--optimizer.zero_stage", "3"], "tp": ["--parallelism.tensor_parallel_degree"]}


def load_reports(folder: Path, layout: str, nproc: int, dump: Path) -> list[dict]:
    extra = LAYOUTS[layout] + ([str(nproc)] if layout == "tp" else [])
    args = [
        "--model.flavor", "from_hf", "--checkpoint.initial_load_path", str(folder),
        "--training.mixed_precision_param", "bfloat16", "--training.seq_len", "32", *extra,
    ]  # fmt: skip
    result = run_train(args, nproc, dump, timeout=1200, script="tests/hf_load_memory.py")
    assert result.returncode == 0, f"loading failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return [json.loads((dump / f"load_rank{rank}.json").read_text()) for rank in range(nproc)]


@pytest.fixture(scope="module")
def ci_sized(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("ci_sized") / "hf"
    assert write_llama_folder(folder, CI_SIZED, shard_bytes=100 * 10**6) == 377_522_176
    return folder


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_each_rank_reads_and_keeps_only_the_shards_it_holds(ci_sized, layout, tmp_path):
    for rank, report in enumerate(load_reports(ci_sized, layout, 2, tmp_path)):
        held, added = report["held_bytes"], report["peak_rss"] - report["rss_before"]
        assert 0.49 * 377_522_176 < held < 0.51 * 377_522_176, (rank, held)  # measured: half, both layouts
        assert report["read_bytes"] == held, (rank, report)
        assert added <= 1.5 * held + 32 * MIB, (rank, added / MIB, held / MIB)  # measured: 1.16 x held
        assert report["peak_rss"] <= report["bound"] == int(1.5 * held) + GIB, (rank, report)
        print(f"{layout} rank {rank}: held and read {held / 1e6:.0f} MB, RSS grew by {added / held:.2f} x held")


@pytest.mark.big_import
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_an_8b_folder_loads_at_4_ranks_within_the_memory_bound(layout, tmp_path_factory, tmp_path):
    folder = tmp_path_factory.getbasetemp() / "llama_8b"
    if not folder.exists():
        assert write_llama_folder(folder, LLAMA_8B) == 16_060_522_496
    reports = load_reports(folder, layout, 4, tmp_path)
    for rank, report in enumerate(reports):
        assert report["read_bytes"] == report["held_bytes"], (rank, report)
        assert report["peak_rss"] <= report["bound"], (rank, report["peak_rss"] / GIB, report["bound"] / GIB)
    print(layout, [(r["held_bytes"] / GIB, r["peak_rss"] / GIB, r["bound"] / GIB, r["seconds"]) for r in reports])
