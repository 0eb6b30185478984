"""What the retrieval-augmented modes (ralm/, knnlm/) share: the knowledge-base client, OS³ stride scheduling and the
round gate that picks sequential, sync or async speculation per round."""
