"""Sharding: how the work spreads over devices."""

from eqx_bsattn._sharding import AbstractSharding as AbstractSharding, Unsharded as Unsharded
