"""`Tiling`: block sizes and launch parameters, forward and backward apart."""

import dataclasses
from collections.abc import Sequence

import equinox as eqx

from ._inputs import python_scalar
from ._strategy import AbstractStrategy


def _field(**kwargs):
    return eqx.field(static=True, converter=python_scalar, **kwargs)


def _check_positive(name: str, value: int | None) -> None:
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
        raise ValueError(f"`Tiling.{name}` must be a positive int or None; got {value!r}.")


class Tiling(AbstractStrategy):
    """Block sizes and launch parameters of a kernel, forward and backward apart.

    Backward fields left at ``None`` take the forward value; ``*_dq`` fields left at ``None``
    take the backward value. ``num_warps``/``num_stages`` are launch parameters that only the
    GPU kernels read. A kernel may refuse a tiling it cannot run (for example, Triton needs
    powers of two of at least 16) with a `ValueError`.

    **Arguments:**

    - `block_q`, `block_kv`: forward block sizes (query rows, key columns of one tile).
    - `block_q_bwd`, `block_kv_bwd`: backward block sizes; default to the forward ones.
    - `num_warps`, `num_stages`: forward launch parameters (GPU).
    - `num_warps_bwd`, `num_stages_bwd`: backward launch parameters (GPU).
    - `block_q_dq`, `block_kv_dq`, `num_warps_dq`, `num_stages_dq`: the dq pass (over
      q-blocks) of a backward split into a dq pass and a dk/dv pass (over kv-blocks); the
      backward fields then tile the dk/dv pass. The plan builds one layout per pass at these
      blocks (`CompiledMask.dq`, `CompiledMask.dkv`); a kernel reads what it uses.

    ```python
    tiling = Tiling(block_q=128, block_kv=64, block_q_bwd=64, block_kv_bwd=128, num_warps=8)
    attn = BlockSparseAttention(mask=masks.Causal(), tiling=tiling)
    ```
    """

    block_q: int = _field()
    block_kv: int = _field()
    block_q_bwd: int | None = _field(default=None)
    block_kv_bwd: int | None = _field(default=None)
    num_warps: int | None = _field(default=None)
    num_stages: int | None = _field(default=None)
    num_warps_bwd: int | None = _field(default=None)
    num_stages_bwd: int | None = _field(default=None)
    block_q_dq: int | None = _field(default=None)
    block_kv_dq: int | None = _field(default=None)
    num_warps_dq: int | None = _field(default=None)
    num_stages_dq: int | None = _field(default=None)

    def __check_init__(self):
        for name in (
            "block_q", "block_kv", "block_q_bwd", "block_kv_bwd",
            "num_warps", "num_stages", "num_warps_bwd", "num_stages_bwd",
            "block_q_dq", "block_kv_dq", "num_warps_dq", "num_stages_dq",
        ):
            _check_positive(name, getattr(self, name))

    @property
    def backward_blocks(self) -> tuple[int, int]:
        """``(block_q, block_kv)`` of the backward pass."""
        return (self.block_q_bwd or self.block_q, self.block_kv_bwd or self.block_kv)

    def explicit(self) -> "Tiling":
        """The same tiling with every backward and dq field spelled out (taken from the field
        it defaults to); launch parameters no field sets stay ``None``."""
        bq, bk = self.backward_blocks
        dq_q, dq_k = self.dq_blocks
        warps_bwd = self.num_warps_bwd or self.num_warps
        stages_bwd = self.num_stages_bwd or self.num_stages
        return Tiling(
            block_q=self.block_q, block_kv=self.block_kv, block_q_bwd=bq, block_kv_bwd=bk,
            num_warps=self.num_warps, num_stages=self.num_stages,
            num_warps_bwd=warps_bwd, num_stages_bwd=stages_bwd,
            block_q_dq=dq_q, block_kv_dq=dq_k,
            num_warps_dq=self.num_warps_dq or warps_bwd,
            num_stages_dq=self.num_stages_dq or stages_bwd,
        )

    def variants(self, *groups: tuple[tuple[str, ...], Sequence[tuple]]) -> tuple["Tiling", ...]:
        """This tiling, then this tiling with one group of fields set to each of its options,
        the groups taken in turn (the first option of every group, then the second, ...) so
        that a short prefix varies every group; duplicates dropped. For a kernel's
        `tiling_candidates`.

        ```python
        base.variants((("block_q", "block_kv"), [(64, 64), (128, 64)]),
                      (("num_warps", "num_stages"), [(4, 2), (8, 3)]))
        ```
        """
        lists = [[dataclasses.replace(self, **dict(zip(fields, option, strict=True)))
                  for option in options] for fields, options in groups]
        ordered = [self]
        for rank in range(max((len(x) for x in lists), default=0)):
            ordered.extend(x[rank] for x in lists if rank < len(x))
        return tuple(dict.fromkeys(ordered))

    @property
    def dq_blocks(self) -> tuple[int, int]:
        """``(block_q, block_kv)`` of the dq pass of a split backward."""
        bq, bk = self.backward_blocks
        return (self.block_q_dq or bq, self.block_kv_dq or bk)
