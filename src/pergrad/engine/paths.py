"""Which engine path a train step takes, from the rule's declarations and the model's settings."""

from __future__ import annotations

from pergrad.engine import chunked, streaming

#: The paths ``engine_path`` chooses between.
STATISTICS_PATH, CHUNKED_PATH, MATERIALIZED_PATH = "statistics", "chunked", "materialized"


def engine_path(aggregator, path: str, microbatch_size: int | None) -> str:
    """The engine path a step tries first, given ``PerExampleModel``'s settings.

    Args:
        aggregator: the model's aggregator.
        path: ``PerExampleModel``'s ``path=`` (``"auto"``, ``"statistics"``,
            ``"materialized"``).
        microbatch_size: ``PerExampleModel``'s ``microbatch_size``.

    Returns:
        ``"statistics"`` (the model may still need the materialized path, found
        out when the step is traced), ``"chunked"`` or ``"materialized"``.
    """
    weighted = chunked.supports(aggregator)
    supported = weighted or streaming.supports(aggregator)
    # Coordinate rules stream whatever the microbatch size: their backward pass has no
    # per-example term, and the microbatch size bounds the blocks they are aggregated in.
    if path != MATERIALIZED_PATH and supported and (
        path == STATISTICS_PATH or microbatch_size is None or not weighted
    ):
        return STATISTICS_PATH
    if microbatch_size is not None and weighted:
        return CHUNKED_PATH
    return MATERIALIZED_PATH
