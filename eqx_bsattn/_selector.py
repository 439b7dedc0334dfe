"""`select_kernel`: which kernel runs a call, and why."""

import dataclasses
from collections.abc import Sequence
from typing import NamedTuple

import jax

from ._compile import ResolvedMask
from ._kernel import AbstractKernel, AbstractLseKernel, Features, registered_kernels
from ._mask import AbstractMask
from ._measured import covering, measured_choice


class NoKernelError(ValueError):
    """No candidate kernel can run the call; the message lists each one and why it declined."""


class KernelChoice(NamedTuple):
    """The selector's answer: the kernel, why it was picked, and who declined before it."""

    kernel: AbstractKernel
    reason: str
    declined: tuple[tuple[str, str], ...]
    #: What the selector assumed about the call, when the caller did not say (else empty).
    assumed: str = ""
    #: Where the platform asked about has no device on this machine: that the kernels were
    #: judged as if it had one, and that the choice runs only there (else empty).
    absent: str = ""

    def explain(self) -> str:
        lines = [f"{self.kernel.name}: {self.reason}"]
        for note in (self.absent, self.assumed):
            if note:
                lines.append(f"  ({note})")
        lines += [f"  declined {name}: {why}" for name, why in self.declined]
        return "\n".join(lines)


def default_platform() -> str:
    """The platform of JAX's default backend: ``"cpu"``, ``"gpu"`` or ``"tpu"``."""
    backend = jax.default_backend()
    return "gpu" if backend in ("gpu", "cuda", "rocm") else backend


#: The platforms JAX names; kernels may add their own (`AbstractKernel.platforms`).
DEVICE_PLATFORMS = ("cpu", "gpu", "tpu")


def known_platforms() -> tuple[str, ...]:
    """``"cpu"``, ``"gpu"``, ``"tpu"`` and any other platform a registered kernel lists."""
    extra = {p for cls in registered_kernels() for p in cls.platforms} - set(DEVICE_PLATFORMS)
    return DEVICE_PLATFORMS + tuple(sorted(extra))


def check_platform(platform, argument: str = "platform") -> str | None:
    """`platform` if it is ``None`` or a known platform, else a `ValueError` listing them."""
    if platform is None:
        return None
    known = known_platforms()
    if isinstance(platform, str) and platform in known:
        return platform
    hint = " (a CUDA or ROCm GPU is 'gpu')" if platform in ("cuda", "rocm") else ""
    raise ValueError(
        f"`{argument}` must be one of {', '.join(map(repr, known))} or None{hint}; "
        f"got {platform!r}."
    )


def platform_absent(platform: str) -> str:
    """Where `platform` is one JAX names (`DEVICE_PLATFORMS`) and this machine has no device
    of it, one line saying that the kernels are judged as if it had one; else ``""``.

    Kernels judge a call by what the platform can do, not by whether this machine has it, so
    that ``select_kernel(mask, "gpu")`` on a laptop says what a GPU would run; running that
    choice here is refused (`blocksparse_attention(platform=...)` checks the device, and a
    GPU kernel's launch refuses in one line)."""
    if platform not in DEVICE_PLATFORMS:
        return ""
    try:
        present = bool(jax.devices(platform))
    except RuntimeError:  # JAX: "Unknown backend" / no platforms of that kind
        present = False
    if present:
        return ""
    return (f"this machine has no {platform} device: each kernel was judged as if one were "
            f"present, and the choice runs only on a {platform}")


def decline_reason(kernel: AbstractKernel, mask: ResolvedMask, features: Features) -> str | None:
    """Why `kernel` cannot run this call (its platforms first, then its own reason), or ``None``."""
    if features.platform not in kernel.platforms:
        return (f"runs on {' / '.join(kernel.platforms)} only; this call runs on "
                f"{features.platform!r}.")
    missing = [kind for kind in features.score if kind not in kernel.score_kinds]
    if missing:
        return (f"does not evaluate the score terms {', '.join(missing)} (it declares "
                f"score_kinds={tuple(kernel.score_kinds)!r}).")
    if features.lse and not isinstance(kernel, AbstractLseKernel):
        return ("does not return the log-sum-exp that sequence sharding merges partial results "
                "by (it is not an AbstractLseKernel).")
    return kernel.decline_reason(mask, features)


def _candidates(platform: str) -> list[AbstractKernel]:
    ranked = []
    for order, cls in enumerate(registered_kernels()):
        priority = cls.priority(platform)
        if priority is None:
            continue
        try:
            kernel = cls()
        except TypeError:  # a kernel that needs arguments is only used when passed explicitly
            continue
        ranked.append((-priority, order, kernel))
    return [kernel for _, _, kernel in sorted(ranked, key=lambda t: t[:2])]


def _with_priorities(kernels: Sequence[AbstractKernel], platform: str) -> str:
    """``"cudnn (40), triton (30)"``: names with their priorities on `platform`."""
    return ", ".join(f"{k.name} ({type(k).priority(platform)})" for k in kernels)


def _why_chosen(kernel: AbstractKernel, pool: Sequence[AbstractKernel], declined: int,
                platform: str, from_registry: bool) -> str:
    """Why `kernel`, the first of `pool` after `declined` others, won: one line."""
    above, below = pool[:declined], pool[declined + 1:]
    if from_registry:
        reason = (f"priority {type(kernel).priority(platform)}, the highest on {platform} among "
                  "the registered kernels that accept this call")
        if above:
            verb = "ranks" if len(above) == 1 else "rank"
            reason += f"; {_with_priorities(above, platform)} {verb} higher but declined"
        if below:
            reason += f"; below it: {_with_priorities(below, platform)}"
        return reason
    reason = f"candidate {declined + 1} of the {len(pool)} given, the first that accepts this call"
    if above:
        reason += f"; declined before it: {', '.join(k.name for k in above)}"
    return reason


def _by_measurement(winner: AbstractKernel, reason: str, below: Sequence[AbstractKernel],
                    mask: ResolvedMask, features: Features,
                    why_not) -> tuple[AbstractKernel, str]:
    """`winner` (first by priority) or a kernel ranked below it that a measured row covering
    the call (`_measured.MEASURED`) times faster forward+backward and that accepts the call
    (`why_not(kernel)` is ``None``); the reason then quotes the figures."""
    row = covering(features, mask.terms)
    if row is None:
        return winner, reason
    by_name = {k.name: k for k in below}
    name, measured = measured_choice(
        row, winner.name, list(by_name),
        lambda n: why_not(by_name[n]) is None)
    if not measured:
        return winner, reason
    if name == winner.name:
        return winner, f"{reason}; {measured}"
    return by_name[name], measured


#: The kernel that runs small calls on a CPU (`small_call`): `DenseReference`, by its name.
DENSE_KERNEL = "reference"
#: A call on a CPU of at most this many query-key pairs a head (``Lq x Lk``) runs dense...
SMALL_CALL_PAIRS = 256 * 256
#: ...when all its heads together hold at most this many (``B x H x Lq x Lk``: 256 MiB of
#: float32 scores), so that a dense call's memory stays bounded where the batch is visible.
SMALL_CALL_ELEMENTS = 1 << 26


def small_call(features: Features) -> str | None:
    """Why a call is small enough that dense attention runs it faster than a block-sparse
    kernel (one line), or ``None``.

    On a CPU, at up to ``256 x 256`` query-key pairs a head, a block layout has a handful of
    blocks: the loops that walk it cost more to trace, compile and run than the pairs they
    skip save (benchmarks/cpu_small_model.py; the table in docs/performance.md). Calls inside
    a sharding keep the block-sparse kernels (a sharding's contract is theirs), as do calls
    whose heads together exceed `SMALL_CALL_ELEMENTS` scores."""
    if features.platform != "cpu" or features.sharded or features.in_loop:
        return None
    pairs = features.q_len * features.kv_len
    if pairs > SMALL_CALL_PAIRS or pairs * features.batch * features.num_heads > SMALL_CALL_ELEMENTS:
        return None
    return (f"a small call on the cpu ({features.q_len} x {features.kv_len} query-key pairs a "
            f"head, at most {SMALL_CALL_PAIRS} = 256 x 256): dense attention traces, compiles "
            "and runs faster than walking a block layout at this size (docs/performance.md)")


def _dense_if_small(winner: AbstractKernel, pool: Sequence[AbstractKernel], mask: ResolvedMask,
                    features: Features) -> tuple[AbstractKernel, str] | None:
    """``(DenseReference, why)`` where `small_call` says the call is small, the registry's
    winner reads a block layout and the dense kernel accepts the call; else ``None``."""
    why = small_call(features)
    if why is None or winner.reads == "dense":
        return None
    dense = next((k for k in pool if k.name == DENSE_KERNEL), None)
    if dense is None or decline_reason(dense, mask, features) is not None:
        return None
    return dense, why


def choose_kernel(
    mask: ResolvedMask, features: Features, candidates: Sequence[AbstractKernel] | None = None,
    *, refuses=None,
) -> KernelChoice:
    """`select_kernel` for a call the plan has resolved. `refuses(kernel)`: why the call's
    sharding cannot run a kernel that accepts the call (`AbstractSharding.kernel_decline`),
    or ``None``; such a kernel is passed over as one that declines."""
    platform = features.platform
    pool = list(candidates) if candidates is not None else _candidates(platform)
    absent = platform_absent(platform)
    declined: list[tuple[str, str]] = []

    def why_not(kernel):
        why = decline_reason(kernel, mask, features)
        if why is None and refuses is not None:
            why = refuses(kernel)
        return why

    for index, kernel in enumerate(pool):
        why = why_not(kernel)
        if why is None:
            reason = _why_chosen(kernel, pool, len(declined), platform, candidates is None)
            if candidates is None:
                dense = _dense_if_small(kernel, pool[index + 1:], mask, features)
                if dense is not None:
                    # The block-sparse winner accepts the call: listed with why it is passed
                    # over, never skipped silently.
                    dense_kernel, why = dense
                    declined.append((kernel.name, "accepts this call, but leaves a small call "
                                     "on the cpu to dense attention (above)"))
                    why += (f"; {kernel.name} (priority {type(kernel).priority(platform)}) "
                            "runs the larger calls")
                    return KernelChoice(dense_kernel, why, tuple(declined), absent=absent)
                kernel, reason = _by_measurement(kernel, reason, pool[index + 1:], mask,
                                                 features, why_not)
            return KernelChoice(kernel, reason, tuple(declined), absent=absent)
        declined.append((kernel.name, why))
    if not pool:
        raise NoKernelError(f"no kernel is registered as a candidate on platform {platform!r}.")
    listing = "\n".join(f"  - {name}: {why}" for name, why in declined)
    raise NoKernelError(
        f"no kernel can run this call on {platform!r}. Each candidate declined:\n{listing}\n"
        "Pass a kernel explicitly (e.g. `kernel=kernels.DenseReference()`), or drop the "
        "feature a candidate names." + (f"\n({absent})" if absent else "")
    )


def select_kernel(
    mask: AbstractMask,
    platform: str | None = None,
    features: Features | None = None,
    candidates: Sequence[AbstractKernel] | None = None,
) -> KernelChoice:
    """Pick the kernel that runs `mask` with `features` on `platform`, and say why.

    Candidates are tried in order (by default: every registered kernel that is an automatic
    candidate on the platform, highest priority first); the first that does not decline wins.
    A kernel declines a platform outside its `platforms`, and whatever its `decline_reason`
    names.

    **Arguments:**

    - `mask`: the attention mask.
    - `platform`: ``"cpu"``, ``"gpu"`` or ``"tpu"`` (or a platform a registered kernel
      lists); defaults to JAX's default backend. It need not be present: this only asks.
      Every kernel is judged as if it were (what a GPU would run, asked on a laptop), and
      the choice's `absent` (shown by `explain()`) says once that this machine lacks it.
    - `features`: what the call asks for (`Features`: lengths, heads, dtype, per-call data);
      defaults to a plain call.
    - `candidates`: kernels to choose among, in order; defaults to the registry's.

    **Returns:** a `KernelChoice` ``(kernel, reason, declined, assumed, absent)``: `reason`
    says why the kernel won (its priority on the platform, the kernels ranked above it that
    declined, whose reasons are in `declined`, and those ranked below; with `candidates`, its
    place in the list), and `explain()` puts it all in a few lines.

    **Raises:** `NoKernelError` (a `ValueError`) naming every candidate and why it declined.

    ```python
    choice = select_kernel(masks.Causal(), platform="cpu")
    print(choice.explain())
    ```
    """
    if not isinstance(mask, AbstractMask):
        raise TypeError(f"`mask` must be an AbstractMask; got {type(mask).__name__}.")
    if features is not None and not isinstance(features, Features):
        raise TypeError(f"`features` must be a Features or None; got {type(features).__name__}.")
    if candidates is not None:
        candidates = list(candidates)
        for kernel in candidates:
            if not isinstance(kernel, AbstractKernel):
                raise TypeError(
                    f"`candidates` must hold AbstractKernel instances; got {type(kernel).__name__}."
                )
    platform = check_platform(platform) or default_platform()
    assumed = ""
    if features is None:
        features = Features(platform=platform)
        assumed = ("no `features` given: assumed a float32 call of one head and length 1; pass "
                   "`features=Features(dtype=..., q_len=..., ...)` to ask about your call")
    elif features.platform != platform:
        features = dataclasses.replace(features, platform=platform)
    resolved = ResolvedMask(mask, q_len=features.q_len, kv_len=features.kv_len,
                            num_heads=features.num_heads)
    try:
        choice = choose_kernel(resolved, features, candidates)
    except NoKernelError as e:
        if assumed:
            raise NoKernelError(f"{e}\n({assumed})") from None
        raise
    return choice._replace(assumed=assumed)
