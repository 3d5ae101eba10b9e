"""A restart from in-memory snapshots (manager.py): every rank lists the snapshot files its folder holds, all
ranks agree on one step, each rank's state is read from its own folder or received from the rank whose folder holds
it (its peer's replica, when its node was replaced), checked, and loaded into the live components.

The agreement is a collective over every rank's listing, so every rank computes the same choice: the newest step
that some folder holds for every rank and that is newer than the disk checkpoint, or none, and then every rank falls
back to the disk checkpoint together. A file that fails its check (torn by the kill, altered, another run's) is
refused on every rank and the choice is made again without it, so a refused file never leaves one rank on another
step than the others.
"""

import logging
import os
from collections import defaultdict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from torchpre.checkpoint.integrity import all_gather
from torchpre.checkpoint.snapshots.file_format import Entry, Expected, SnapshotError, parse_name, tensor_at, verify
from torchpre.checkpoint.state import Checkpointable, flatten, load_component, load_targets
from torchpre.checkpoint.values import put_values, without_values
from torchpre.confined import open_file

logger = logging.getLogger("torchpre")


@dataclass(frozen=True)
class Listing:
    """What one rank's folder holds (`files`: rank, step and name of each snapshot file), where (`place`: its node
    and folder, shared by the ranks of a node), the most bytes this rank's own snapshot may have (`limit`), and the
    newest disk checkpoint's step (rank 0's counts)."""

    rank: int
    place: str
    files: tuple[tuple[int, int, str], ...]
    limit: int
    disk_step: int


@dataclass(frozen=True)
class Here:
    """This rank's side of a restore: its folder on its node, the group the ranks agree on, its live components, and
    what its snapshot of a step must be (`expected(step)`)."""

    rank: int
    node: str
    folder: Path
    group: dist.ProcessGroup
    components: Mapping[str, Checkpointable]
    expected: Callable[[int], Expected]


@dataclass(frozen=True)
class Restored:
    """The step every rank resumed from, and how many ranks' state came from another rank's folder."""

    step: int
    from_peers: int


Refused = set[tuple[int, int, int, str]]  # rank, step, the rank whose folder held it, the file


def choose(listings: list[Listing], refused: Refused) -> tuple[int, dict[int, tuple[int, str]]] | None:
    """The newest step held for every rank and newer than rank 0's disk checkpoint, and for each rank who reads its
    file and its name: the rank itself when its own folder holds it (its own file before a replica), else the lowest
    rank whose folder does. None when no step qualifies."""
    holders: dict[tuple[int, int], list[tuple[int, str]]] = defaultdict(list)
    for listing in listings:
        for rank, step, name in listing.files:
            if rank < len(listings) and (rank, step, listing.rank, name) not in refused:
                holders[rank, step].append((listing.rank, name))
    newer_than = listings[0].disk_step
    steps = {step for _, step in holders if step > newer_than}
    complete = [step for step in steps if all((rank, step) in holders for rank in range(len(listings)))]
    if not complete:
        return None
    step = max(complete)
    plan = {
        rank: min(holders[rank, step], key=lambda held: (held[0] != rank, held[1].endswith(".replica"), held[0]))
        for rank in range(len(listings))
    }
    return step, plan


def restore(here: Here, disk_step: int, excluded: list[str]) -> Restored | None:
    """Loads the agreed snapshot into `here`'s components (all but `excluded`), or returns None on every rank."""
    rank, group = here.rank, here.group
    limit = here.expected(0).size_limit
    mine = Listing(rank, f"{here.node}:{here.folder}", _list(here.folder), limit, disk_step)
    listings = all_gather(mine, group)
    refused: Refused = set()
    while (choice := choose(listings, refused)) is not None:
        step, plan = choice
        data, failure = _fetch(here, listings, step, plan)
        result = None
        if failure is None:
            holder, name = plan[rank]
            source = Path(listings[holder].place.split(":", 1)[1]) / name
            try:
                values, payload = verify(data, here.expected(step), source)
                result = (values, payload, source)
            except SnapshotError as error:
                failure = str(error)
        failures = all_gather(failure, group)
        if not any(failures):
            _load(here, here.expected(step).entries, *result, excluded)
            from_peers = sum(plan[r][0] != r for r in range(len(listings)))
            _keep_only(here, listings, step)
            if rank == 0:
                logger.info(
                    "resumed from the in-memory snapshots of step %d (newer than the disk checkpoint's step %d); %d "
                    "rank(s) restored from a peer's replica", step, disk_step, from_peers,
                )  # fmt: skip
            return Restored(step, from_peers)
        for failed, why in enumerate(failures):
            if why is not None:
                holder, name = plan[failed]
                refused.add((failed, step, holder, name))
                if rank == failed:
                    logger.warning("the snapshot of rank %d at step %d is not used: %s", failed, step, why)
    _keep_only(here, listings, None)
    if rank == 0 and any(listing.files for listing in listings):
        logger.warning(
            "no in-memory snapshot step is complete for every rank and newer than the disk checkpoint's step %d: "
            "every rank resumes from the disk checkpoint", disk_step,
        )  # fmt: skip
    return None


def _list(folder: Path) -> tuple[tuple[int, int, str], ...]:
    """The snapshot files in `folder`: regular files whose names say a rank and step."""
    try:
        found = [
            (entry.name, parse_name(entry.name)) for entry in os.scandir(folder) if entry.is_file(follow_symlinks=False)
        ]
    except OSError:
        return ()
    return tuple(sorted((parsed[0], parsed[1], name) for name, parsed in found if parsed is not None))


def _fetch(here: Here, listings: list[Listing], step: int, plan: dict[int, tuple[int, str]]):
    """This rank's snapshot bytes, read from its folder or received from the rank `plan` names, which reads and
    sends them; every rank serves the others in rank order, so the pairs never wait on each other in a cycle.
    Returns (bytes, None) or (None, why not)."""
    rank, data, failure = here.rank, None, None
    for subject in range(len(listings)):
        holder, name = plan[subject]
        if holder == rank:
            read, why = _read(here.folder, name, listings[subject].limit)
            if subject == rank:
                data, failure = read, why
            else:
                _send(read, subject, here.group)
        elif subject == rank:
            data = _receive(holder, listings[rank].limit, here.group)
            if data is None:
                failure = f"rank {holder} could not read {name} from its folder"
    return data, failure


def _read(folder: Path, name: str, limit: int) -> tuple[bytearray | None, str | None]:
    try:
        with open_file(folder, name) as file:
            size = os.fstat(file.fileno()).st_size
            if size > limit:
                return None, f"{folder / name} has {size:,} bytes, more than a snapshot of this rank can ({limit:,})"
            data = bytearray(size)
            if file.readinto(data) != size:
                return None, f"{folder / name} shrank while it was read"
    except Exception as error:  # gone, a link, not a file: the file is not used, whatever it is
        return None, f"{folder / name} cannot be read ({error})"
    return data, None


def _send(data: bytearray | None, to: int, group: dist.ProcessGroup) -> None:
    dist.send(
        torch.tensor([len(data) if data is not None else -1], dtype=torch.int64), group_dst=_in(group, to), group=group
    )
    if data is not None and len(data):
        dist.send(torch.frombuffer(data, dtype=torch.uint8), group_dst=_in(group, to), group=group)


def _receive(source: int, limit: int, group: dist.ProcessGroup) -> bytearray | None:
    size = torch.empty(1, dtype=torch.int64)
    dist.recv(size, group_src=_in(group, source), group=group)
    length = int(size.item())
    if length < 0:
        return None
    data = bytearray(length)
    if length:
        dist.recv(torch.frombuffer(data, dtype=torch.uint8), group_src=_in(group, source), group=group)
    return data if length <= limit else None


def _in(group: dist.ProcessGroup, rank: int) -> int:
    return dist.get_group_rank(group, rank)


def _load(
    here: Here, entries: tuple[Entry, ...], values: dict[str, Any], payload: memoryview, source: Path,
    excluded: list[str],
) -> None:  # fmt: skip
    """The snapshot's tensors copied into what each component loads (its `load_targets`), its values put beside
    them, and each component's `load_state_dict`, as a disk checkpoint's load does."""
    by_name = {entry[0]: entry for entry in entries}
    saved = set(by_name) | set(values)
    request = {key: load_targets(component, saved) for key, component in here.components.items() if key not in excluded}
    loaded = without_values(request, values)
    with torch.no_grad():
        for name, target in flatten(loaded).items():
            entry = by_name.get(name)
            held = target.to_local() if hasattr(target, "to_local") else target
            if entry is None or tuple(held.shape) != entry[2]:
                raise RuntimeError(f"{source}: the entry {name!r} is not in the snapshot as this rank loads it")
            held.copy_(tensor_at(payload, entry))
    put_values(loaded, request, values, source)
    for key, state in loaded.items():
        load_component(here.components[key], key, state, source)


def _keep_only(here: Here, listings: list[Listing], step: int | None) -> None:
    """The first rank of each folder removes its files of other steps than `step` and temporary files a killed job
    left, once every rank has read what it needed."""
    dist.barrier(group=here.group)
    places = [listing.place for listing in listings]
    if places.index(places[here.rank]) != here.rank:
        return
    try:
        names = [entry.name for entry in os.scandir(here.folder) if entry.is_file(follow_symlinks=False)]
    except OSError:
        return
    for name in names:
        parsed = parse_name(name)
        if name.startswith(".tmp-") or (parsed is not None and parsed[1] != step):
            (here.folder / name).unlink(missing_ok=True)
