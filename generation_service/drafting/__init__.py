"""Draft trees for speculative decoding: the drafters (in process, or the retrieval service's datastore drafts via
retrieval_client) and the draft budget that sizes each tree from the measured pass cost and acceptance."""
