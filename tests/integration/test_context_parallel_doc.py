"""docs/context-parallel.md runs as written in CI, not only in the full docs run (`-m readme`): its bash blocks, in
order, in a folder that looks like a clone, each train.py shortened as every docs block is (test_readme.py)."""

import pytest

from tests.doc_blocks import REPO, blocks
from tests.integration.test_readme import make_clone, run_blocks

DOC = REPO / "docs" / "context-parallel.md"


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_every_command_of_the_context_parallel_page_runs(tmp_path):
    shell = [block for block in blocks(DOC) if block.language == "bash"]
    assert len(shell) == 5 and not any(block.skip for block in shell)
    run_blocks(shell, make_clone(tmp_path))
