"""The README's comparison with other frameworks names a source for every cell (issue 63).

A neighbour's cell (torchtitan, nanotron, Megatron) links at least one key of docs/comparison.md; every key there
names its project, a source and a date, and is cited by some cell; a torchpre cell names a test, a command or a page
of docs/ that exists. docs/performance.md's numbers of other frameworks link keys too.
"""

import re

from tests.launch import REPO

SOURCES = REPO / "docs" / "comparison.md"
NEIGHBOURS = {"torchtitan": "T", "nanotron": "N", "Megatron": "M"}  # column header prefix -> key prefix
KEY_LINK = re.compile(r"\[([TNM]\d+)\]\((?:docs/)?comparison\.md#([tnm]\d+)\)")
DATE = re.compile(r"^20\d\d-[01]\d-[0-3]\d$")


def split_row(line: str) -> list[str]:
    return [cell.strip() for cell in re.split(r"(?<!\\)\|", line)[1:-1]]


def table_after(text: str, header_start: str) -> tuple[list[str], list[list[str]]]:
    """The header and rows of the markdown table whose header line starts with `header_start`."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header_start))
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        rows.append(split_row(line))
    return split_row(lines[start]), rows


def sources() -> dict[str, list[str]]:
    """Key -> (project, source, date, what it says), from docs/comparison.md's table."""
    _, rows = table_after(SOURCES.read_text(), "| key |")
    table = {}
    for key_cell, *rest in rows:
        anchor = re.fullmatch(r'<a id="([tnm]\d+)"></a>([TNM]\d+)', key_cell)
        assert anchor and anchor.group(1) == anchor.group(2).lower(), key_cell
        assert anchor.group(2) not in table, f"{anchor.group(2)} twice"
        table[anchor.group(2)] = rest
    return table


def comparison() -> tuple[list[str], list[list[str]]]:
    return table_after((REPO / "README.md").read_text(), "| | torchpre |")


def keys_in(cell: str) -> list[str]:
    links = KEY_LINK.findall(cell)
    for key, anchor in links:
        assert key.lower() == anchor, f"{key} links #{anchor}"
    return [key for key, _ in links]


def test_every_neighbour_cell_links_a_source_of_its_own_project():
    header, rows = comparison()
    table = sources()
    columns = {i: prefix for i, name in enumerate(header)
               for start, prefix in NEIGHBOURS.items() if name.startswith(start)}  # fmt: skip
    assert sorted(columns.values()) == ["M", "N", "T"], header
    assert len(rows) >= 30
    for row in rows:
        for i, prefix in columns.items():
            keys = keys_in(row[i])
            assert keys, f"{row[0]!r}, {header[i]}: no source ({row[i]!r})"
            for key in keys:
                assert key in table, f"{row[0]!r}, {header[i]}: {key} is not in docs/comparison.md"
                assert key.startswith(prefix), f"{row[0]!r}, {header[i]}: {key} is another project's source"


def test_every_source_has_a_project_a_source_and_a_date_and_is_cited():
    table = sources()
    projects = {"T": "torchtitan", "N": "nanotron", "M": "Megatron-LM"}
    for key, (project, source, date, says) in table.items():
        assert project == projects[key[0]], key
        assert DATE.match(date), f"{key}: date {date!r}"
        assert source and says, key
    texts = [(REPO / path).read_text() for path in ("README.md", "docs/performance.md")]
    cited = {key for text in texts for key, _ in KEY_LINK.findall(text)}
    assert cited == set(table), f"cited nowhere: {sorted(set(table) - cited)}; missing: {sorted(cited - set(table))}"


def test_every_torchpre_cell_names_a_test_a_command_or_a_page_that_exists():
    header, rows = comparison()
    for row in rows:
        cell = row[header.index("torchpre")]
        pages = re.findall(r"\]\((docs/[\w./-]+\.md)(?:#[\w-]+)?\)", cell)
        named = re.findall(r"tests/[\w/]+\.py|python -m [\w.]+|--[\w.]+", cell)
        assert pages or named, f"{row[0]!r}: the torchpre cell names no test, command or page ({cell!r})"
        for page in pages:
            assert (REPO / page).is_file(), f"{row[0]!r}: {page} does not exist"
        for path in re.findall(r"tests/[\w/]+\.py", cell):
            assert (REPO / path).is_file(), f"{row[0]!r}: {path} does not exist"


def test_other_frameworks_numbers_in_the_performance_page_link_their_sources():
    """docs/performance.md quotes other frameworks' published MFU: each quote links a key."""
    text = (REPO / "docs" / "performance.md").read_text()
    start = text.index("For reference, Megatron-Core reports")
    quote = text[start : text.index("\n\n", start)]
    assert {key for key, _ in KEY_LINK.findall(quote)} == {"M26", "T26", "N11"}, quote
