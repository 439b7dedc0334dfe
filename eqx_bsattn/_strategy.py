"""`AbstractStrategy`: the base of the kernel, tiling and sharding strategies; `is_abstract`."""

import abc
import dataclasses
import inspect
import weakref
from typing import ClassVar, get_origin

from equinox import AbstractClassVar

#: Strategies declared abstract with ``is_abstract=True`` (equinox's class keyword) although
#: every member they declare is defined.
_DECLARED_ABSTRACT: "weakref.WeakSet[type]" = weakref.WeakSet()


def is_abstract(cls: type) -> bool:
    """Whether `cls` is an abstract class, in equinox's sense: it leaves an abstract method,
    an `eqx.AbstractVar` or an `eqx.AbstractClassVar` undefined, or it says so with
    ``is_abstract=True`` (a keyword `AbstractStrategy` subclasses take). Works for
    `eqx.Module` and `AbstractStrategy` subclasses alike.

    ```python
    is_abstract(AbstractKernel), is_abstract(kernels.XlaBlockSparse)   # True, False
    ```
    """
    if not inspect.isclass(cls):
        raise TypeError(f"`cls` must be a class; got {type(cls).__name__}.")
    if inspect.isabstract(cls) or cls in _DECLARED_ABSTRACT:
        return True
    # Modules carry both sets (equinox's metaclass); strategies the class variables alone.
    return bool(getattr(cls, "__abstractvars__", ()) or getattr(cls, "__abstractclassvars__", ()))


def _abstract_class_vars(cls: type) -> frozenset[str]:
    """The names `cls` or a base annotates `AbstractClassVar[...]` that no class has set since:
    equinox's rule, for strategies (which are dataclasses, not modules)."""
    names: set[str] = set()
    for klass in reversed(cls.__mro__):
        for name, annotation in inspect.get_annotations(klass).items():
            if get_origin(annotation) is AbstractClassVar:
                if name in vars(klass):
                    raise TypeError(f"{klass.__name__}.{name} is an AbstractClassVar; it cannot "
                                    "have a value where it is declared.")
                names.add(name)
        names -= vars(klass).keys()
    return frozenset(names)


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
    retraces. (Masks that hold no arrays are such leaves too; one that holds arrays,
    `masks.ArrayMask`, is a pytree node, so that its arrays are traced.)

    Abstract members follow equinox: `abc.abstractmethod`, and `eqx.AbstractClassVar[T]` for a
    class variable every concrete subclass sets (a `ClassVar[T]` with a value); a class that
    leaves one undefined cannot be instantiated (`is_abstract`).

    ```python
    class MyKernel(AbstractKernel):
        unroll: int = 1               # a field: MyKernel(unroll=2) == MyKernel(unroll=2)
    ```
    """

    __abstractclassvars__: ClassVar[frozenset[str]] = frozenset()

    def __init_subclass__(cls, *, is_abstract: bool = False, **kwargs):
        super().__init_subclass__(**kwargs)
        if is_abstract:
            _DECLARED_ABSTRACT.add(cls)
        cls.__abstractclassvars__ = _abstract_class_vars(cls)
        # Abstract class variables are no fields: hide them from the dataclass, as equinox does.
        own = inspect.get_annotations(cls)
        cls.__annotations__ = {name: annotation for name, annotation in own.items()
                               if get_origin(annotation) is not AbstractClassVar}
        dataclasses.dataclass(frozen=True)(cls)
        cls.__annotations__ = own

    def __new__(cls, *args, **kwargs):
        if cls in _DECLARED_ABSTRACT:
            raise TypeError(f"Can't instantiate abstract class {cls.__name__}.")
        if cls.__abstractclassvars__:
            raise TypeError(f"Can't instantiate abstract class {cls.__name__} without the class "
                            f"variables {', '.join(sorted(cls.__abstractclassvars__))}.")
        return super().__new__(cls)

    def __post_init__(self):
        for field in dataclasses.fields(self):
            converter = field.metadata.get("converter")
            if converter is not None:
                object.__setattr__(self, field.name, converter(getattr(self, field.name)))
        for klass in reversed(type(self).__mro__):
            check = vars(klass).get("__check_init__")
            if check is not None:
                check(self)


_DECLARED_ABSTRACT.add(AbstractStrategy)
