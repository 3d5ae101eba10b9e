"""Writes docs/config-reference.md, the reference of every option, from the config dataclasses (what `--help` prints).

    python scripts/config_reference.py          # rewrite docs/config-reference.md
    python scripts/config_reference.py --check  # exit 1 naming the file when it is stale (tests/unit/test_docs.py)
"""

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from torchpre.config.job_config import JobConfig  # noqa: E402
from torchpre.config.parser import format_reference  # noqa: E402
from torchpre.generate import GenerateConfig  # noqa: E402

PATH = REPO / "docs" / "config-reference.md"

HEADER = """# Configuration reference

**Look up any option**: its TOML section and key, type, default and meaning. Generated from
`torchpre/config/job_config.py` by `python scripts/config_reference.py` (the same text `python train.py --help`
prints); `tests/unit/test_docs.py` fails when this page is stale. How to set options, and what happens to a
mistyped one, is in [configuration.md](configuration.md).

Values come from the defaults, then the TOML file (`--job.config_file`), then the command line (highest
precedence). Forms: `--section.key value`, `--section.key=value`, a bare `--section.key` for a true bool;
true/false, 1/0, yes/no for bools; `a,b,c` for lists; `name=0.7,other=0.3` for dicts; `none` unsets an optional
value. In a TOML file the key `section.key` is `key = value` under `[section]`.

## Training: `train.py`, `python -m torchpre.train`, `torchpre.plan`, `torchpre.convert`

"""

GENERATE = """
## Generation: `python -m torchpre.generate`

Every option above (the job whose checkpoint it loads), plus:

"""


def render() -> str:
    return HEADER + format_reference(JobConfig) + GENERATE + format_reference(GenerateConfig, skip=JobConfig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--check", action="store_true", help="fail when docs/config-reference.md is not what it renders"
    )
    text = render()
    if parser.parse_args().check:
        if PATH.read_text(encoding="utf-8") != text:
            sys.exit(f"{PATH.relative_to(REPO)} is stale: run python scripts/config_reference.py")
        return
    PATH.write_text(text, encoding="utf-8")
    print(f"wrote {PATH.relative_to(REPO)} ({len(text.splitlines())} lines)")


if __name__ == "__main__":
    main()
