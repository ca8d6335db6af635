"""Which ranks share a node, and which ranks keep each rank's replicas.

Nodes are found, never configured: ranks whose local roots are the same folder (equal hostname,
device and inode) are one node. Nodes are numbered in the order of their lowest rank. Replica
``k`` (1, 2, ...) of a rank on node ``n`` goes to node ``n + k`` (mod the number of nodes), to
the rank there with the same position within its node (mod that node's size) -- so replicas
spread evenly and never land on the node they protect.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Topology:
    """Nodes and replica targets of one world.

    Attributes:
        node_of: rank -> its node's number.
        ranks_of: node -> its ranks, ascending.
        replicas: how many replicas each shard has (capped at the number of other nodes).
    """

    node_of: tuple[int, ...]
    ranks_of: tuple[tuple[int, ...], ...]
    replicas: int

    @classmethod
    def from_keys(cls, keys: Sequence[Any], replicas: int) -> Topology:
        numbers: dict[str, int] = {}
        node_of = []
        for key in keys:
            node_of.append(numbers.setdefault(repr(list(key)), len(numbers)))
        ranks_of = tuple(
            tuple(r for r, n in enumerate(node_of) if n == node) for node in range(len(numbers))
        )
        return cls(tuple(node_of), ranks_of, min(replicas, len(numbers) - 1))

    @property
    def nodes(self) -> int:
        return len(self.ranks_of)

    def leader(self, rank: int) -> bool:
        """Whether ``rank`` is the lowest rank of its node (the one that deletes there)."""
        return self.ranks_of[self.node_of[rank]][0] == rank

    def holder(self, shard: int, node: int) -> int:
        """The rank of ``node`` that keeps rank ``shard``'s shard there."""
        if self.node_of[shard] == node:
            return shard
        home = self.ranks_of[self.node_of[shard]]
        ranks = self.ranks_of[node]
        return ranks[home.index(shard) % len(ranks)]

    def homes(self, shard: int) -> list[int]:
        """The nodes that keep rank ``shard``'s shard: its own, then each replica's."""
        own = self.node_of[shard]
        return [(own + k) % self.nodes for k in range(self.replicas + 1)]
