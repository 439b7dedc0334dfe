"""Sharding: how the work spreads over devices."""

from eqx_bsattn.contract import AbstractSharding as AbstractSharding, Unsharded as Unsharded
