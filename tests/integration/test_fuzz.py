"""The fuzzer of every format torchpre reads from others (tests/fuzz): a seeded sample in CI, the full run behind the
`fuzz` marker (docs/testing.md reports its last one)."""

import os
import random

import pytest

from tests.fuzz import formats
from tests.fuzz.paths import LOAD_PATHS
from tests.fuzz.run import fuzz

pytestmark = pytest.mark.slow

SAMPLE_SEED, SAMPLE_CASES = "ci-2026-12-07", 300
FULL_CASES = int(os.environ.get("TORCHPRE_FUZZ_CASES", "20000"))


@pytest.mark.timeout(1800)
def test_a_seeded_sample_holds_the_invariant_on_every_load_path(tmp_path):
    report = fuzz(SAMPLE_CASES, SAMPLE_SEED, tmp_path)
    print(report.summary())
    assert not report.failures, report.summary()
    assert {outcome.load_path for outcome in report.outcomes} == {path.name for path in LOAD_PATHS}
    targets = {mutation.target.rsplit("/", 1)[-1] for outcome in report.outcomes for mutation in outcome.mutations}
    assert {"tokenizer.json", "tokenizer_config.json"} <= targets, "the sample mutates no Hugging Face tokenizer"
    kinds = {outcome.kind for outcome in report.outcomes}
    assert {"refused", "same"} <= kinds, "a sample that is never refused, or never loads, tests nothing"


@pytest.mark.fuzz
@pytest.mark.timeout(6 * 3600)
def test_the_full_run_with_a_fresh_seed(tmp_path):
    seed = os.environ.get("TORCHPRE_FUZZ_SEED") or str(random.SystemRandom().randrange(10**9))
    print(f"fuzz seed {seed}")
    report = fuzz(FULL_CASES, seed, tmp_path, workers=2, progress=True)
    print(report.summary())
    assert not report.failures, report.summary()


def test_the_gadgets_name_every_global_the_metadata_interpreter_allows():
    """A global added to the interpreter's table is a gadget's target at once, beside the payloads' globals."""
    from torchpre.checkpoint.metadata_pickle import GLOBALS

    assert set(GLOBALS) <= set(formats.GADGET_GLOBALS) and ("builtins", "exec") in formats.GADGET_GLOBALS
    assert {name for module, name in GLOBALS if module.endswith("checkpoint.metadata")} >= {"Metadata", "StorageMeta"}
