"""kNN-LM decoding: the model's next-token distribution interpolated with nearest neighbours from a datastore, with
RaLMSpec's speculative retrieval rounds. options (what a request may ask, its stats) <- distribution (p_kNN, the
interpolation) <- cache (the per-request neighbour cache) <- search (the retrieval service and datastore side) <-
passes (LM passes that yield the query vector) <- loop (the decoding loops, the request the engine steps)."""
