"""How the encoder process cuts the asks that arrived together into batches for the tower."""

from __future__ import annotations


def encoder_batches(mm_hashes: list[str], cost_of, max_items: int, max_embeddings: int) -> list[list[str]]:
    """Asks cut into batches, in order, of at most `max_items` items and `max_embeddings`
    embeddings to compute (an item larger than that alone): the tower's activations grow
    with embeddings, not with the item count, so eight large images are not one batch."""
    batches: list[list[str]] = []
    batch: list[str] = []
    embeddings = 0
    for mm_hash in mm_hashes:
        cost = cost_of(mm_hash)
        if batch and (len(batch) >= max_items or embeddings + cost > max_embeddings):
            batches.append(batch)
            batch, embeddings = [], 0
        batch.append(mm_hash)
        embeddings += cost
    if batch:
        batches.append(batch)
    return batches
