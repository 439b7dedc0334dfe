"""Score terms: what a kernel adds to each logit before the soft cap, by head and position.

`ALiBi` (linear in the distance), `RelativePositionBias` (T5's learned table of bucketed
distances) and `ScoreFunction` (any jnp function, like `masks.Predicate` for masks). Pass one
as `BlockSparseAttention(score=...)`; see docs/scores.md. Kernels read the compiled
`ScoreTerms` (`eqx_bsattn.contract`), never these classes.
"""

from eqx_bsattn.contract import (
    AbstractScore as AbstractScore,
    RelativeBuckets as RelativeBuckets,
    ScoreTerm as ScoreTerm,
    ScoreTerms as ScoreTerms,
)

from .builtin import (
    ALiBi as ALiBi,
    RelativePositionBias as RelativePositionBias,
    ScoreFunction as ScoreFunction,
    alibi_slopes as alibi_slopes,
)
from .flex import from_flex as from_flex
