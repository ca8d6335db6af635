"""The node-local tier of a multi-tier manager (``LocalTierOptions``; docs/multi-tier.md).

- :mod:`.shard`: one rank's items as plain state (its own DTensor shards, with their global
  shape and offset), written in the state handler's format and loaded back in place;
- :mod:`.local_store`: a node's local root: per-rank shard folders committed by a marker
  written last and a rename, listed, verified and deleted;
- :mod:`.transfer`: files sent between ranks over the manager's gloo group, checked on arrival;
- :mod:`.topology`: which ranks share a node, and where each rank's replicas go;
- :mod:`.local_tier`: the agreements of a local save and of a restore from the local tier.
"""
