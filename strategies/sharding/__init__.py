"""Sharding: how the work spreads over devices."""

from eqx_bsattn.contract import AbstractSharding as AbstractSharding, Unsharded as Unsharded

from .shard_map import ShardMap as ShardMap
from .ring import RingAttention as RingAttention, RingSchedule as RingSchedule
from .all_to_all import AllToAll as AllToAll, AllToAllRing as AllToAllRing
from .cost import (
    choose_sequence_sharding as choose_sequence_sharding,
    collective_bytes as collective_bytes,
    SequenceChoice as SequenceChoice,
)
from .balance import (
    balanced_chunks as balanced_chunks,
    Dispatch as Dispatch,
    dispatch_documents as dispatch_documents,
)
