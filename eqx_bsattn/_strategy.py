"""`AbstractStrategy`: the base of the kernel, tiling and sharding strategies."""

import abc
import dataclasses


class AbstractStrategy(abc.ABC):
    """Static configuration of a `BlockSparseAttention`: a kernel, a tiling or a sharding.

    Every subclass is a frozen dataclass of hashable fields (declare them as annotated class
    attributes; `eqx.field(default=..., converter=...)` works, and `__check_init__` runs after
    the converters), compared and hashed by value.

    A strategy is deliberately *not* a pytree node: a module holds it as one leaf that is not
    an array. So `eqx.filter(model, eqx.is_array)`, the gradients of `eqx.filter_grad` and an
    optimizer state built from them hold ``None`` there whichever strategy it is, and a model
    whose kernel was swapped with `eqx.tree_at` keeps the pytree structure of the optimizer
    state (and of its twin's gradients); `eqx.filter_jit` treats the leaf as static, so a swap
    retraces. (Masks stay pytrees: they may hold per-call arrays, `masks.ArrayMask`.)

    ```python
    class MyKernel(AbstractKernel):
        unroll: int = 1               # a field: MyKernel(unroll=2) == MyKernel(unroll=2)
    ```
    """

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        dataclasses.dataclass(frozen=True)(cls)

    def __post_init__(self):
        for field in dataclasses.fields(self):
            converter = field.metadata.get("converter")
            if converter is not None:
                object.__setattr__(self, field.name, converter(getattr(self, field.name)))
        for klass in reversed(type(self).__mro__):
            check = vars(klass).get("__check_init__")
            if check is not None:
                check(self)
