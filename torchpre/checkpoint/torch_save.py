"""The archives `torch.save` writes, as DCP stores each tensor and each non-tensor entry, checked before torch or
anyone allocates what they claim.

torch.load reads two formats. Its legacy one (before torch 1.6) declares each storage's size in its pickle and
allocates that much before reading a byte: 30 bytes of file can ask for 2.7 GB. Its zip format allocates each record
at the size its directory states, which for a compressed record may be a thousand times the bytes behind it. DCP
writes only zip archives of stored (uncompressed) records, so `open_archive` refuses anything else, and a record's
size is then bounded by the bytes in the file.

Non-tensor entries (checkpoints before `state.json` kept plain values this way) are decoded without torch.load:
`read_plain_value` interprets the archive's `data.pkl` as a plain value (pickled.py), after bounding the entry to
`MAX_PLAIN_VALUE` bytes, so no entry allocates more than that before it is validated.
"""

from __future__ import annotations

import io
import os
import zipfile
from typing import BinaryIO, cast

from torchpre.checkpoint.pickled import PLAIN_VALUES, PlainValue, Refused, interpret

MAGIC = b"PK\x03\x04"  # a zip archive's first local header
MAX_RECORDS = 1024  # records of one archive; torch.save writes 6 and one per storage
MAX_PLAIN_VALUE = 1 << 20  # bytes of one non-tensor entry read as a plain value; genuine ones hold about 1,300


class NotAnArchive(Exception):
    """Why bytes are no archive as torch.save writes it."""


class Window(io.RawIOBase):
    """Bytes `start` to `start + length` of `file` as a seekable file of their own, read with pread (so that no
    read, seek or buffering of `file` moves it, and none leaves the window): what zipfile and torch.load read."""

    def __init__(self, file: BinaryIO, start: int, length: int) -> None:
        super().__init__()
        self._fd, self.start, self.length, self._position = file.fileno(), start, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._position

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        base = {os.SEEK_SET: 0, os.SEEK_CUR: self._position, os.SEEK_END: self.length}[whence]
        if base + offset < 0:
            raise OSError(f"seek to {base + offset} before the start")
        self._position = base + offset
        return self._position

    def readinto(self, buffer: bytearray | memoryview) -> int:
        count = max(0, min(len(buffer), self.length - self._position))
        data = os.pread(self._fd, count, self.start + self._position) if count else b""
        buffer[: len(data)] = data
        self._position += len(data)
        return len(data)


def open_archive(file: BinaryIO, length: int) -> zipfile.ZipFile:
    """`file` (`length` bytes, seekable) as a zip archive of stored records, each inside it; NotAnArchive saying why
    otherwise."""
    file.seek(0)
    if file.read(len(MAGIC)) != MAGIC:
        raise NotAnArchive(
            "it is not in torch.save's zip format (torch's legacy format allocates whatever its pickle claims before "
            "reading it)"
        )
    try:
        archive = zipfile.ZipFile(file)
    except (zipfile.BadZipFile, zipfile.LargeZipFile, OSError, EOFError, ValueError) as error:
        raise NotAnArchive(f"its zip directory is damaged ({error})") from None
    records = archive.infolist()
    if len(records) > MAX_RECORDS:
        raise NotAnArchive(f"it holds {len(records):,} records; torch.save writes a handful")
    for record in records:
        if record.compress_type != zipfile.ZIP_STORED or record.compress_size != record.file_size:
            raise NotAnArchive(f"its record {record.filename!r} is compressed; torch.save stores records as they are")
        if record.header_offset + record.file_size > length:
            raise NotAnArchive(f"its record {record.filename!r} claims {record.file_size:,} bytes past its end")
    return archive


def read_plain_value(data: bytes) -> PlainValue:
    """The plain value (None, a bool, number, string, bytes, or a list, tuple or dict of them) that the torch.save
    archive `data` holds; NotAnArchive or pickled.Refused saying why it holds no such value."""
    if len(data) > MAX_PLAIN_VALUE:
        raise NotAnArchive(f"it holds {len(data):,} bytes; a plain value is read from at most {MAX_PLAIN_VALUE:,}")
    archive = open_archive(io.BytesIO(data), len(data))
    pickles = [name for name in archive.namelist() if name.rsplit("/", 1)[-1] == "data.pkl"]
    if len(pickles) != 1:
        raise NotAnArchive(f"it holds {len(pickles)} data.pkl records, not one")
    if any("/data/" in name for name in archive.namelist()):
        raise Refused("it holds tensor storages")
    return cast(PlainValue, interpret(archive.read(pickles[0]), PLAIN_VALUES))
