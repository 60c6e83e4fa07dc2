"""Decisions (Ster's `decide`): typed questions answered from the next-token distribution over
option letters at one position, every option shown under every letter and the orders averaged,
the shared state read once through the KV cache. request.py reads and checks the request,
prompt.py renders it, answer.py turns letter logits into answers, run.py drives the ranks.
Calibration (`ster calibrate`): labelled.py reads labelled requests, temperature.py fits and
scores a temperature, calibrate.py reads the labelled requests through the engine, and
calibration.py is the ster-calibration/1 artifact `decide --calibration` applies."""
