"""The Hugging Face exporter in one process, without a training job: what it writes equals the family's mapping of
the model's state dict bitwise, a `step-N` folder never exists while its files are being written, retention keeps
the newest, a failed write publishes nothing, and the tensors' owners split the bytes among the ranks holding them
(the multi-rank layouts, against transformers, are in tests/integration/test_hf_export_eval.py)."""

import dataclasses
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

import torchpre.training.hf_export as hf_export
from torchpre.config.job_config import HFExport
from torchpre.data.tokenizer import DEFAULT_TOKENIZER_PATH, Tokenizer
from torchpre.errors import StorageError
from torchpre.models.llama3.args import LLAMA3_FLAVORS
from torchpre.models.llama3.hf import to_hf_state_dict
from torchpre.models.llama3.model import Transformer
from torchpre.models.registry import get_model_spec
from torchpre.training.hf_export import HFExporter, TensorInfo, _balanced_owners

TOKENIZER = Tokenizer(DEFAULT_TOKENIZER_PATH)


def _exporter(folder: Path, flavor: str = "tiny", **settings) -> tuple[HFExporter, Transformer]:
    args = dataclasses.replace(LLAMA3_FLAVORS[flavor], vocab_size=TOKENIZER.vocab_size, max_seq_len=32)
    with torch.device("meta"):
        model = Transformer(args)
    model.to_empty(device="cpu")
    model.init_weights(0)
    parallel = SimpleNamespace(parts=[model])  # what the exporter asks of a ParallelModel
    exporter = HFExporter(
        folder, HFExport(enable=True, **settings), parallel, get_model_spec("llama3"), args, TOKENIZER, 32
    )
    return exporter, model


@pytest.mark.parametrize("flavor", ["tiny", "debugmodel_tied"])
def test_the_export_is_the_familys_mapping_of_the_state_dict_bitwise(world, tmp_path, flavor):
    exporter, model = _exporter(tmp_path, flavor, async_mode="disabled")
    exporter.export(3)
    step_dir = tmp_path / "step-3"
    expected = to_hf_state_dict(model.state_dict(), model.args)
    written = load_file(step_dir / "model.safetensors")
    assert written.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(written[name], tensor), name
    assert json.loads((step_dir / "config.json").read_text())["tie_word_embeddings"] == model.args.tie_word_embeddings
    assert sorted(path.name for path in step_dir.iterdir()) == [
        "config.json", "generation_config.json", "model.safetensors", "tokenizer.model", "tokenizer_config.json",
    ]  # fmt: skip


def test_no_step_folder_exists_while_its_files_are_written(world, tmp_path, monkeypatch):
    """In the background: while the weights are written, only `.tmp-step-2` exists; then `step-2`, complete."""
    seen = []
    save = hf_export.save_safetensors

    def watched_save(tensors, path):
        seen.append(sorted(p.name for p in tmp_path.iterdir()))
        save(tensors, path)

    monkeypatch.setattr(hf_export, "save_safetensors", watched_save)
    exporter, _ = _exporter(tmp_path)
    exporter.export(2)
    exporter.wait()
    assert seen == [[".tmp-step-2"]]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-2"]
    assert (tmp_path / "step-2" / "model.safetensors").is_file()
    exporter.close()


def test_retention_keeps_the_newest_and_a_restart_removes_unfinished_exports(world, tmp_path):
    (tmp_path / ".tmp-step-1").mkdir(parents=True)
    exporter, _ = _exporter(tmp_path, keep_latest_k=2)
    exporter.remove_unfinished()
    for step in (2, 4, 6):
        exporter.export(step)
    exporter.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-4", "step-6"]


def test_a_failed_write_publishes_nothing_and_raises_at_the_next_export(world, tmp_path, monkeypatch):
    def full_disk(tensors, path):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(hf_export, "save_safetensors", full_disk)
    exporter, _ = _exporter(tmp_path)
    exporter.export(2)
    with pytest.raises(StorageError, match=r"export of step 2 .* failed \(rank 0: OSError: .*No space left"):
        exporter.export(4)
    assert list(tmp_path.iterdir()) == []


def test_owners_are_holders_and_split_the_bytes():
    """Eight equal tensors held by two ranks and one held by a third: four each, the third owns its own."""
    infos = {f"w{i}": TensorInfo((4, 4), torch.float32, (0, 1)) for i in range(8)}
    infos["norm"] = TensorInfo((4,), torch.float32, (2,))
    owners = _balanced_owners(infos)
    assert owners["norm"] == 2
    assert sorted(owners[f"w{i}"] for i in range(8)) == [0, 0, 0, 0, 1, 1, 1, 1]
