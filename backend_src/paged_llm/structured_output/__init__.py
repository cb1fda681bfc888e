"""Grammar-constrained decoding with xgrammar: compiling a request's constraint (in worker processes,
off the engine's step loop, cached), one grammar matcher per constrained sequence, and the token
bitmask each step applies to the constrained rows' logits."""
