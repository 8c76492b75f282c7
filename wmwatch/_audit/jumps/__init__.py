"""Who moved the watermark: the batches whose event time ran ahead or whose watermark jumped,
the rows that did it, and what the jump cost; ``section`` is its report section."""
