"""Sharding: how the work spreads over devices."""

from eqx_bsattn.contract import AbstractSharding as AbstractSharding, Unsharded as Unsharded

from .shard_map import ShardMap as ShardMap
from .ring import RingAttention as RingAttention, RingSchedule as RingSchedule
