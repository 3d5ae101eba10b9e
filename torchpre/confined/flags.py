"""The open(2) flags that keep an open inside a folder, read or written, each 0 where the system lacks it."""

import os

CLOEXEC = getattr(os, "O_CLOEXEC", 0)
NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
DIRECTORY = getattr(os, "O_DIRECTORY", 0)
NONBLOCK = getattr(os, "O_NONBLOCK", 0)  # a FIFO in place of a file opens at once, and is refused as no file
