"""The one way torchpre opens a file in a folder someone else may have made (`read`), and the one way it writes into
a run folder (`write`), so that neither ever reaches outside the folder (docs/security.md). The names other modules
import are handed on here."""

from torchpre.confined.read import (
    OpenFolder,
    check_name,
    confined_path,
    file_kind,
    located,
    open_file,
    open_named,
    openat2_available,
    read_file,
    read_named,
)
from torchpre.confined.write import (
    is_regular_file,
    make_folder,
    open_for_append,
    open_new,
    open_replacing,
    replacing_path,
    touch_marker,
    write_file,
)

__all__ = [
    "OpenFolder", "check_name", "confined_path", "file_kind", "is_regular_file", "located", "make_folder", "open_file",
    "open_for_append", "open_named", "open_new", "open_replacing", "openat2_available", "read_file", "read_named",
    "replacing_path", "touch_marker", "write_file",
]
