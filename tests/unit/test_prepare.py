"""`python -m torchpre.data.prepare`: round trips per input format, worker-count independence, resume
after an interruption, refusal of another dataset in the same folder, and errors that say what to do."""

import json
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest

from scripts import tiny_tokenizer
from torchpre.data import prepare
from torchpre.data.prepare import main, task_folder
from torchpre.data.shards import JOURNAL, MANIFEST, Manifest, ShardReader, journal_line
from torchpre.data.tiktoken_bpe import load_ranks, save_ranks
from torchpre.data.tokenizer import DEFAULT_TOKENIZER_PATH, load_tokenizer
from torchpre.errors import TorchpreError

TOKENIZER = load_tokenizer(DEFAULT_TOKENIZER_PATH)
SHA256 = TOKENIZER.sha256
SHARD_TOKENS = 1000  # a few documents per shard, so that the inputs below make several shards


def make_documents() -> list[str]:
    """Varied lengths (one longer than a shard), non-ASCII, quotes, escapes and newlines."""
    rng = random.Random(0)
    words = ["the", "quick", "fox", "café", "naïve", "数据", "🙂", '"quoted"', "back\\slash", "tab\t", "new\nline"]
    documents = [" ".join(rng.choices(words, k=rng.randint(3, 120))) for _ in range(40)]
    return documents + [" ".join(words * 60)]


DOCUMENTS = make_documents()


def expected_ids(documents: list[str]) -> list[list[int]]:
    return [TOKENIZER.encode(text, bos=True, eos=True) for text in documents]


def run(inputs: list[Path | str], output: Path, *options: str) -> None:
    """The command in this process, with small shards and one worker unless `options` say otherwise."""
    main([*map(str, inputs), "--output", str(output), "--shard-tokens", str(SHARD_TOKENS), "--workers", "1", *options])


def read_back(folder: Path) -> list[list[int]]:
    reader = ShardReader(folder, TOKENIZER.vocab_size, expected_tokenizer_sha256=SHA256)
    return [
        reader.document(index, doc).tolist()
        for index, shard in enumerate(reader.shards)
        for doc in range(shard.num_documents)
    ]


def folder_bytes(folder: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(folder.iterdir())}


def write_jsonl(path: Path, documents: list[str]) -> Path:
    """One record per line with an extra field, plus a blank line and an empty text (both skipped)."""
    lines = [json.dumps({"id": i, "text": text}) for i, text in enumerate(documents)]
    lines[1:1] = ["", json.dumps({"id": -1, "text": ""})]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def write_txt_folder(folder: Path, documents: list[str]) -> Path:
    """Nested folders, read recursively in sorted order; a file with another suffix is ignored."""
    for i, text in enumerate(documents):
        path = folder / ("a" if i < len(documents) // 2 else "b") / f"doc_{i:03d}.txt"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    (folder / "README.md").write_text("not a document")
    return folder


def write_parquet(path: Path, documents: list[str]) -> Path:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    table = pa.table({"id": list(range(len(documents))), "text": documents})
    pq.write_table(table, path, row_group_size=7)  # several row groups
    return path


def write_hf_dataset(folder: Path, documents: list[str]) -> Path:
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_dict({"text": documents, "id": list(range(len(documents)))}).save_to_disk(str(folder))
    return folder


def write_hf_dataset_dict(folder: Path, documents: list[str]) -> Path:
    datasets = pytest.importorskip("datasets")
    splits = {"train": ["not this split"], "validation": documents}
    datasets.DatasetDict(
        {name: datasets.Dataset.from_dict({"text": texts}) for name, texts in splits.items()}
    ).save_to_disk(str(folder))
    return folder


FORMATS = {
    "txt": (write_txt_folder, "texts", []),
    "jsonl": (write_jsonl, "data.jsonl", []),
    "parquet": (write_parquet, "data.parquet", []),
    "hf": (write_hf_dataset, "dataset", []),
    "hf-split": (write_hf_dataset_dict, "dataset_dict", ["--hf-split", "validation"]),
}


@pytest.mark.parametrize("kind", FORMATS)
def test_round_trip_equals_direct_encoding(kind, tmp_path):
    write, name, options = FORMATS[kind]
    source = write(tmp_path / name, DOCUMENTS)
    run([source], tmp_path / "out", *options)
    assert read_back(tmp_path / "out") == expected_ids(DOCUMENTS)
    manifest = Manifest.read(tmp_path / "out")
    assert len(manifest.shards) > 3
    assert (manifest.tokenizer_name, manifest.tokenizer_sha256, manifest.vocab_size) == (
        DEFAULT_TOKENIZER_PATH.name,
        SHA256,
        TOKENIZER.vocab_size,
    )
    # At most SHARD_TOKENS per shard, unless one document alone is longer.
    reader = ShardReader(tmp_path / "out", TOKENIZER.vocab_size)
    for index, shard in enumerate(manifest.shards):
        assert shard.num_tokens <= SHARD_TOKENS or shard.num_documents == 1
        if index + 1 < len(manifest.shards):  # cut only when the next document would not fit
            assert shard.num_tokens + len(reader.document(index + 1, 0)) > SHARD_TOKENS


def test_several_inputs_are_concatenated_in_order(tmp_path):
    first = write_jsonl(tmp_path / "first.jsonl", DOCUMENTS[:10])
    second = tmp_path / "second.txt"
    second.write_text(DOCUMENTS[10], encoding="utf-8")
    run([first, second], tmp_path / "out")
    assert read_back(tmp_path / "out") == expected_ids(DOCUMENTS[:11])


def test_output_is_identical_for_1_and_2_workers(tmp_path):
    source = write_jsonl(tmp_path / "data.jsonl", DOCUMENTS * 3)
    run([source], tmp_path / "one", "--workers", "1")
    run([source], tmp_path / "two", "--workers", "2")
    assert folder_bytes(tmp_path / "one") == folder_bytes(tmp_path / "two")


@pytest.fixture
def written_shards(monkeypatch) -> list[str]:
    """Names of the shards written from now on."""
    names = []
    write_shard = prepare.write_shard

    def spy(folder, name, documents, vocab_size):
        names.append(name)
        return write_shard(folder, name, documents, vocab_size)

    monkeypatch.setattr(prepare, "write_shard", spy)
    return names


def test_resume_after_an_interruption_writes_only_the_missing_shards(tmp_path, monkeypatch, written_shards):
    source = write_jsonl(tmp_path / "data.jsonl", DOCUMENTS)
    run([source], tmp_path / "reference")
    reference = Manifest.read(tmp_path / "reference")
    spy = prepare.write_shard

    def crash_on_third_shard(folder, name, documents, vocab_size):
        if len(written_shards) == 2:
            raise RuntimeError("simulated crash")
        return spy(folder, name, documents, vocab_size)

    monkeypatch.setattr(prepare, "write_shard", crash_on_third_shard)
    written_shards.clear()
    with pytest.raises(RuntimeError, match="simulated crash"):
        run([source], tmp_path / "out", "--workers", "2")
    interrupted = Manifest.read(tmp_path / "out")
    assert [s.name for s in interrupted.shards] == ["shard_00000", "shard_00001"]
    assert not interrupted.complete
    assert json.loads((tmp_path / "out" / MANIFEST).read_text())["shards"] == []  # listed by the journal alone
    assert len((tmp_path / "out" / JOURNAL).read_bytes().splitlines()) == 2
    with pytest.raises(TorchpreError, match="incomplete.*Re-run the same prepare command"):
        ShardReader(tmp_path / "out", TOKENIZER.vocab_size)

    monkeypatch.setattr(prepare, "write_shard", spy)
    written_shards.clear()
    run([source], tmp_path / "out")
    assert written_shards == [shard.name for shard in reference.shards[2:]]
    assert folder_bytes(tmp_path / "out") == folder_bytes(tmp_path / "reference")


def test_resume_rewrites_an_unlisted_or_damaged_shard_even_from_moved_inputs(tmp_path, written_shards):
    source = write_jsonl(tmp_path / "data.jsonl", DOCUMENTS)
    run([source], tmp_path / "out")
    reference = folder_bytes(tmp_path / "out")
    names = [shard.name for shard in Manifest.read(tmp_path / "out").shards]
    moved = tmp_path / "moved" / "renamed.jsonl"  # same content elsewhere: the fingerprint ignores paths
    moved.parent.mkdir()
    moved.write_bytes(source.read_bytes())

    manifest = Manifest.read(tmp_path / "out")
    del manifest.shards[-1]
    manifest.complete = False
    manifest.write(tmp_path / "out")
    written_shards.clear()
    run([moved], tmp_path / "out")
    assert written_shards == names[-1:]
    assert folder_bytes(tmp_path / "out") == reference

    bin_file = tmp_path / "out" / f"{names[1]}.bin"
    bin_file.write_bytes(bin_file.read_bytes()[:-2])
    written_shards.clear()
    run([moved], tmp_path / "out")
    assert written_shards == names[1:]
    assert folder_bytes(tmp_path / "out") == reference


def test_the_manifest_is_written_twice_whatever_the_shard_count(tmp_path, monkeypatch):
    """Once at the start and once at the end, never per shard (which made prepare quadratic in the shard count);
    the journal that lists the shards meanwhile is gone when prepare is done."""
    writes = []
    write = Manifest.write
    monkeypatch.setattr(Manifest, "write", lambda manifest, folder: writes.append(len(manifest.shards)) or
                        write(manifest, folder))  # fmt: skip
    run([write_jsonl(tmp_path / "data.jsonl", DOCUMENTS)], tmp_path / "out", "--shard-tokens", "100")
    shards = len(Manifest.read(tmp_path / "out").shards)
    assert shards == len(DOCUMENTS) and writes == [0, shards]
    assert not (tmp_path / "out" / JOURNAL).exists()


def test_a_journal_line_cut_short_by_a_crash_lists_no_shard_and_the_resume_writes_it_again(tmp_path, written_shards):
    source = write_jsonl(tmp_path / "data.jsonl", DOCUMENTS)
    run([source], tmp_path / "out")
    reference, manifest = folder_bytes(tmp_path / "out"), Manifest.read(tmp_path / "out")
    lines = [journal_line(i, shard) for i, shard in enumerate(manifest.shards)]
    names = [shard.name for shard in manifest.shards]
    manifest.shards, manifest.complete = [], False
    manifest.write(tmp_path / "out")
    (tmp_path / "out" / JOURNAL).write_bytes(b"".join(lines[:3]) + lines[3][:-9])
    assert [s.name for s in Manifest.read(tmp_path / "out").shards] == names[:3]
    written_shards.clear()
    run([source], tmp_path / "out")
    assert written_shards == names[3:]
    assert folder_bytes(tmp_path / "out") == reference


@pytest.mark.parametrize("tasks", [4, 50])  # 50 tasks for 41 files: some parts are empty
def test_prepare_split_over_tasks_then_merged_is_byte_identical_to_one_task(tasks, tmp_path):
    inputs = write_txt_folder(tmp_path / "texts", DOCUMENTS)
    run([inputs], tmp_path / "one")
    for index in reversed(range(tasks)):  # any order, any machine
        run([inputs], tmp_path / "split", "--num-tasks", str(tasks), "--task-index", str(index))
    parts = [Manifest.read(task_folder(tmp_path / "split", i, tasks)) for i in range(tasks)]
    assert sum(len(part.source["inputs"]) for part in parts) == len(DOCUMENTS)  # each file read by one task
    main(["--merge", "--num-tasks", str(tasks), "--output", str(tmp_path / "split")])
    assert folder_bytes(tmp_path / "split") == folder_bytes(tmp_path / "one")


def test_a_merge_resumes_after_an_interruption_and_refuses_missing_or_unfinished_parts(
    tmp_path, monkeypatch, written_shards
):
    inputs = write_txt_folder(tmp_path / "texts", DOCUMENTS)
    run([inputs], tmp_path / "one")
    for index in range(3):
        run([inputs], tmp_path / "split", "--num-tasks", "4", "--task-index", str(index))
    merging = ["--merge", "--num-tasks", "4", "--output", str(tmp_path / "split")]
    with pytest.raises(TorchpreError, match=r"Task 3 of 4 has written no part: .*split\.task-00003-of-00004"):
        main(merging)
    run([inputs], tmp_path / "split", "--num-tasks", "4", "--task-index", "3")
    spy = prepare.write_shard

    def crash_on_fourth_shard(folder, name, documents, vocab_size):
        if name == "shard_00003":
            raise RuntimeError("simulated crash")
        return spy(folder, name, documents, vocab_size)

    monkeypatch.setattr(prepare, "write_shard", crash_on_fourth_shard)
    with pytest.raises(RuntimeError, match="simulated crash"):
        main(merging)
    monkeypatch.setattr(prepare, "write_shard", spy)
    written_shards.clear()
    main(merging)
    assert written_shards[0] == "shard_00003"
    assert folder_bytes(tmp_path / "split") == folder_bytes(tmp_path / "one")
    part = Manifest.read(task_folder(tmp_path / "split", 1, 4))
    part.complete = False
    part.write(task_folder(tmp_path / "split", 1, 4))
    with pytest.raises(TorchpreError, match=r"Task 1 of 4 has not finished its part .*--task-index 1"):
        main(merging)


def test_rerun_of_a_complete_folder_does_nothing(tmp_path, written_shards, capsys):
    source = write_jsonl(tmp_path / "data.jsonl", DOCUMENTS)
    run([source], tmp_path / "out")
    written_shards.clear()
    run([source], tmp_path / "out")
    assert written_shards == []
    assert "nothing to do" in capsys.readouterr().out


def other_tokenizer(path: Path) -> Path:
    """A valid tokenizer other than the default: its last merge dropped."""
    ranks = load_ranks(DEFAULT_TOKENIZER_PATH)
    last = max(ranks.values())
    save_ranks({token: rank for token, rank in ranks.items() if rank != last}, path)
    return path


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda tmp: ["--tokenizer", str(other_tokenizer(tmp / "other.model"))], "made with the tokenizer"),
        (lambda tmp: ["--shard-tokens", "2000"], "made with --shard-tokens 1000, not 2000"),
        (lambda tmp: ["--text-field", "body"], "made with --text-field text, not body"),
    ],
    ids=["tokenizer", "shard-tokens", "text-field"],
)
def test_refuses_another_tokenizer_or_options_in_a_used_folder(change, message, tmp_path):
    source = tmp_path / "data.jsonl"
    source.write_text("".join(json.dumps({"text": t, "body": t}) + "\n" for t in DOCUMENTS), encoding="utf-8")
    run([source], tmp_path / "out")
    before = folder_bytes(tmp_path / "out")
    with pytest.raises(TorchpreError, match=rf"{tmp_path / 'out'} holds shards .*{message}.*another --output"):
        run([source], tmp_path / "out", *change(tmp_path))
    assert folder_bytes(tmp_path / "out") == before


def test_refuses_other_inputs_in_a_used_folder(tmp_path):
    source = write_jsonl(tmp_path / "data.jsonl", DOCUMENTS)
    run([source], tmp_path / "out")
    with open(source, "a", encoding="utf-8") as file:
        file.write(json.dumps({"text": "one more document"}) + "\n")
    with pytest.raises(TorchpreError, match=r"different dataset: input 1, .*data\.jsonl .*differs"):
        run([source], tmp_path / "out")
    with pytest.raises(TorchpreError, match="made from 1 inputs, not 2"):
        run([write_jsonl(tmp_path / "a.jsonl", DOCUMENTS), source], tmp_path / "out")


def test_shard_reader_names_a_truncated_file(tmp_path):
    run([write_jsonl(tmp_path / "data.jsonl", DOCUMENTS)], tmp_path / "out")
    index = tmp_path / "out" / "shard_00002.idx"
    index.write_bytes(index.read_bytes()[:-8])
    reader = ShardReader(tmp_path / "out", TOKENIZER.vocab_size)  # the .idx is read by `document` only
    with pytest.raises(TorchpreError, match=rf"Shard file {index} has .* bytes, but {MANIFEST} says"):
        reader.document(2, 0)


def test_shard_reader_refuses_another_tokenizer_hash(tmp_path):
    run([write_jsonl(tmp_path / "data.jsonl", DOCUMENTS)], tmp_path / "out")
    other = load_tokenizer(other_tokenizer(tmp_path / "other.model")).sha256
    with pytest.raises(TorchpreError, match="made with tokenizer 'tokenizer.model'.*model.tokenizer_path"):
        ShardReader(tmp_path / "out", TOKENIZER.vocab_size, expected_tokenizer_sha256=other)


@pytest.mark.parametrize("kind", ["byte_level", "byte_fallback"])
def test_a_hugging_face_tokenizer_prepares_transformers_ids_framed_as_its_family_and_ties_its_hash(kind, tmp_path):
    """Each document as `tokenizer(text)` gives it (BOS for Mistral's kind, none for Qwen's), then EOS; the same
    shards from 1 and 2 workers (the workers get the tokenizer pickled); the manifest names the folder and records
    its hash, and a reader expecting another tokenizer's refuses the shards."""
    transformers = pytest.importorskip("transformers")
    folder = tiny_tokenizer.write(kind, tmp_path / kind)
    reference, ours = transformers.AutoTokenizer.from_pretrained(folder), load_tokenizer(folder)
    source = write_jsonl(tmp_path / "data.jsonl", DOCUMENTS)
    run([source], tmp_path / "one", "--tokenizer", str(folder))
    run([source], tmp_path / "two", "--tokenizer", str(folder), "--workers", "2")
    assert folder_bytes(tmp_path / "one") == folder_bytes(tmp_path / "two")
    reader = ShardReader(tmp_path / "one", ours.vocab_size, expected_tokenizer_sha256=ours.sha256)
    shards = [reader.document(i, doc).tolist() for i, shard in enumerate(reader.shards)
              for doc in range(shard.num_documents)]  # fmt: skip
    assert shards == [reference(text)["input_ids"] + [reference.eos_token_id] for text in DOCUMENTS]
    manifest = Manifest.read(tmp_path / "one")
    assert (manifest.tokenizer_name, manifest.tokenizer_sha256) == (kind, ours.sha256)
    other = load_tokenizer(tiny_tokenizer.write("unigram", tmp_path / "other")).sha256
    with pytest.raises(TorchpreError, match=f"made with tokenizer '{kind}'.*model.tokenizer_path"):
        ShardReader(tmp_path / "one", ours.vocab_size, expected_tokenizer_sha256=other)


def write_file(name: str, content: str):
    def write(tmp: Path) -> Path:
        path = tmp / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(content, encoding="utf-8")
        return path

    return write


@pytest.mark.parametrize(
    "make_input, message",
    [
        (write_file("bad.jsonl", '{"text": "fine"}\n{"text": "cut\n'), r"bad\.jsonl \(line 2\) is not valid JSON"),
        (
            write_file("keys.jsonl", '{"body": "x"}\n'),
            r"keys\.jsonl:1 has no 'text' field \(found 'body'\).*--text-field",
        ),
        (write_file("type.jsonl", '{"text": 3}\n'), r"type\.jsonl:1: 'text' holds a int, not a string"),
        (write_file("blank.jsonl", '{"text": "  "}\n\n'), r"hold no text: every document is empty"),
        (write_file("data.csv", "text\nx\n"), r"data\.csv has the unknown suffix '\.csv'"),
        (lambda tmp: write_file("only/notes.md", "x")(tmp).parent, r"only holds no \.txt, \.jsonl, \.parquet files"),
        (lambda tmp: tmp / "missing.jsonl", r"Input '.*missing\.jsonl' does not exist\. Give"),
    ],
    ids=["bad-json", "missing-field", "not-a-string", "empty", "unknown-suffix", "no-usable-file", "missing"],
)
def test_bad_input_fails_with_a_message_naming_it(make_input, message, tmp_path):
    with pytest.raises(TorchpreError, match=message):
        run([make_input(tmp_path)], tmp_path / "out")


@pytest.mark.parametrize("kind", ["parquet", "hf"])
def test_a_table_without_the_text_column_fails_naming_its_columns(kind, tmp_path):
    write, name, _ = FORMATS[kind]
    source = write(tmp_path / name, ["a"])
    with pytest.raises(TorchpreError, match=rf"{name} has no column 'body' \(columns: .*text.*\)\. Pass --text-field"):
        run([source], tmp_path / "out", "--text-field", "body")


def test_refuses_a_non_empty_folder_that_is_not_a_shard_folder(tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "notes.txt").write_text("mine")
    with pytest.raises(TorchpreError, match=r"out is not empty and holds no manifest\.json"):
        run([write_jsonl(tmp_path / "data.jsonl", DOCUMENTS)], tmp_path / "out")


def test_hub_name_offline_fails_fast_with_what_to_do(tmp_path, monkeypatch):
    pytest.importorskip("datasets")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))  # an empty cache
    started = time.perf_counter()
    with pytest.raises(TorchpreError) as error:
        run(["some-org/some-dataset"], tmp_path / "out")
    assert time.perf_counter() - started < 10
    message = str(error.value)
    assert "'some-org/some-dataset'" in message and "HF_HUB_OFFLINE=1" in message
    assert "save_to_disk(DIR)" in message and "give that local DIR" in message


def test_hub_name_without_datasets_says_what_to_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # makes `import datasets` fail
    with pytest.raises(TorchpreError, match=r"pip install torchpre\[hf\]"):
        run(["some-org/some-dataset"], tmp_path / "out")


def test_command_line_prints_the_throughput(tmp_path):
    source = write_jsonl(tmp_path / "data.jsonl", DOCUMENTS)
    command = [sys.executable, "-m", "torchpre.data.prepare", str(source), "--output", str(tmp_path / "out")]
    result = subprocess.run([*command, "--workers", "2"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert f"{len(DOCUMENTS):,} documents" in result.stdout
    assert "tokens/s" in result.stdout and "MB/s per core" in result.stdout
    assert read_back(tmp_path / "out") == expected_ids(DOCUMENTS)
