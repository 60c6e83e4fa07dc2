"""Decisions (Ster's `decide`): typed questions answered from the next-token distribution over
option letters at one position, every option shown under every letter and the orders averaged,
the shared state read once through the KV cache. request.py reads and checks the request,
prompt.py renders it, answer.py turns letter logits into answers, run.py drives the ranks."""
