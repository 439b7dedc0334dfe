"""Masks: which (query, key) pairs attend. Compose with ``&``, ``|`` and ``~``."""

from eqx_bsattn.contract import (
    EMPTY as EMPTY,
    FULL as FULL,
    PARTIAL as PARTIAL,
    AbstractBlockMask as AbstractBlockMask,
    AbstractMask as AbstractMask,
    And as And,
    BlockCoords as BlockCoords,
    Document as Document,
    Full as Full,
    MaskTerms as MaskTerms,
    NonPaddingKeys as NonPaddingKeys,
    Not as Not,
    Or as Or,
    TokenCoords as TokenCoords,
    classify as classify,
)

from .custom import PerHead as PerHead, Predicate as Predicate, from_flex as from_flex
from .positional import (
    Causal as Causal,
    ChunkedCausal as ChunkedCausal,
    PrefixLM as PrefixLM,
    SlidingWindow as SlidingWindow,
)
from .sparse import (
    BigBirdRandom as BigBirdRandom,
    BlockLayoutMask as BlockLayoutMask,
    Dilated as Dilated,
    GlobalTokens as GlobalTokens,
)
from .array import ArrayMask as ArrayMask
