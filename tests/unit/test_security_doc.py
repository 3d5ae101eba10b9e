"""docs/security.md states exactly what is checked, and every claim in it is held by a test: each paragraph and each
list item outside code blocks and headings names at least one test as `tests/PATH.py::test_name`, and every test so
named exists (a function of that name in that file)."""

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PAGE = REPO / "docs" / "security.md"
REFERENCE = re.compile(r"`(tests/[\w/]+\.py)::(\w+)")


def claims(text: str) -> list[str]:
    """The page's paragraphs and list items (continuation lines joined), without headings and code blocks."""
    found, current, in_code = [], [], False
    for line in text.splitlines() + [""]:
        if line.startswith("```"):
            in_code = not in_code
            continue
        if in_code:
            continue
        starts = line.startswith(("- ", "#")) or not line.strip()
        if starts and current:
            found.append(" ".join(current))
            current = []
        if line.strip() and not line.startswith("#"):
            current.append(line.strip())
    return found


def test_every_claim_of_the_security_page_names_a_test():
    unsupported = [claim[:100] for claim in claims(PAGE.read_text()) if not REFERENCE.search(claim)]
    assert not unsupported, f"claims of docs/security.md that name no test: {unsupported}"


def test_every_test_the_security_page_names_exists():
    missing = []
    for path, name in REFERENCE.findall(PAGE.read_text()):
        source = REPO / path
        if not source.is_file() or not re.search(rf"^def {name}\(", source.read_text(), re.M):
            missing.append(f"{path}::{name}")
    assert not missing, f"docs/security.md names tests that do not exist: {missing}"


def test_the_check_of_claims_finds_a_claim_without_a_test():
    page = "# T\n\nA claim with `tests/unit/x.py::test_y`.\n\n- an item\n  without one\n\n```bash\nnot a claim\n```\n"
    assert [claim for claim in claims(page) if not REFERENCE.search(claim)] == ["- an item without one"]
