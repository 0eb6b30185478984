"""kNN-LM decoding: the model's next-token distribution interpolated with nearest neighbours from a datastore, with
speculative retrieval rounds (loop)."""
