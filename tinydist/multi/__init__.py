"""Tensors over several devices of one process: sharding and allreduce algorithms."""

from tinydist.multi.allreduce import ALGORITHMS, allreduce
from tinydist.multi.sharded import MultiTensor, ShardError, shard

__all__ = ["ALGORITHMS", "MultiTensor", "ShardError", "allreduce", "shard"]
