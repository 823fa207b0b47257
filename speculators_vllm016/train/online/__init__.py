"""Online training: the target extracts hidden states while the draft trains on them."""
