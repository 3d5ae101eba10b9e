"""docs/context-parallel.md runs as written: its bash blocks, in order, in a folder that looks like a clone, each
train.py shortened to the tiny model on 32-token sequences as the README's blocks are (test_readme.py)."""

import pytest

from tests.integration.test_readme import REPO, make_clone, readme_blocks, run_blocks

DOC = REPO / "docs" / "context-parallel.md"


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_every_command_of_the_context_parallel_page_runs(tmp_path):
    blocks = [block for block in readme_blocks(DOC) if block.language == "bash"]
    assert len(blocks) == 5
    run_blocks(blocks, make_clone(tmp_path))
