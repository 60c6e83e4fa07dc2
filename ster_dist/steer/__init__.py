"""Ster's steering half across ranks: capture hidden states at the per-layer hook sites, fit
directions from contrastive pairs (caa, pca, logistic), score them, and add them to the residual
stream during generation. Rank-side work runs as rank extensions (workers/extension.py); the
residual is replicated over tensor-parallel ranks, so capture reads rank 0 and steering adds on
every rank."""
