"""A structure-aware fuzzer of every format torchpre reads from others, run through every load path.

Each case copies genuine inputs (a checkpoint, a signed checkpoint, a checkpoint of main at 0a62600, Hugging Face
folders, a shard folder, a tiktoken file, a Hugging Face tokenizer with text prepared with it and a released folder
that ships it, a task file: `genuine.py`), applies one to three mutations a format knows how
to make of its files (`formats.py`: fields deleted, types swapped, huge, negative and NaN numbers, deep nesting, long
strings, paths with `..`, `/` and NUL; pickle programs built on every global a reader could allow; headers and
offsets; a symbolic link, a FIFO or a folder in place of any file or folder), and runs one load path on them
(`paths.py`: resume, initial weights from a checkpoint or a Hugging Face folder, generate, convert both ways, plan
from a released folder, prepare with either tokenizer, training on shards, training from a released folder on the
shards of its own tokenizer, evaluation tasks) as a forked child of a warm interpreter, under
an address-space bound and an audit hook (tests/fork_server.py).

The invariant (`run.py`): the child exits 0 with the unmutated input's result, or exits 2 with a message that names
a file of the case; a mutation that only changes a value within its valid range may change the result instead. Never
another exit code, a traceback, a timeout, an event on a file outside the case's input folders (the targets of the
planted links), a change to one, or an address space over the bound.
"""
