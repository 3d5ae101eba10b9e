"""Which rank keeps the replica of which rank's snapshot (checkpoint.memory_replicas = 1): a rank on another node, so
that losing one node never loses both copies of any rank's state.

A node is what shares a snapshot folder: the host and, under torchrun, the agent's node rank (GROUP_RANK; two agents
on one machine are two nodes, as the tests run them). Ranks are listed node after node and each sends its snapshot
to the rank as many places further on as the largest node has ranks: with nodes of equal size, the rank of the same
local index on the next node. That is a permutation, so every rank also keeps exactly one other rank's replica. On
one node the peer is the next rank, which guards against losing one rank's files, not the node.
"""

import os
import socket


def node_key() -> str:
    """This process's node: its host name and, under torchrun, its agent's node rank."""
    group = os.environ.get("GROUP_RANK")
    return socket.gethostname() + (f"/{group}" if group is not None else "")


def peer_ranks(nodes: list[str]) -> list[int]:
    """For each rank (`nodes[r]` its node), the rank that keeps its replica."""
    order = sorted(range(len(nodes)), key=lambda rank: (nodes.index(nodes[rank]), rank))
    largest = max(nodes.count(node) for node in set(nodes))
    shift = largest if largest < len(nodes) else 1
    peers = [0] * len(nodes)
    for position, rank in enumerate(order):
        peers[rank] = order[(position + shift) % len(nodes)]
    return peers


def same_node_peers(nodes: list[str], peers: list[int]) -> list[int]:
    """The ranks whose replica stays on their own node although the job has several (nodes of unequal size)."""
    if len(set(nodes)) < 2:
        return []
    return [rank for rank, peer in enumerate(peers) if nodes[peer] == nodes[rank]]
