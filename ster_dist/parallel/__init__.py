"""Tensor- and expert-parallel primitives below the model: which rank this process is and its
collectives (ctx.py: ParallelCtx, Shard), and the layers that hold a rank's share of a matrix
(linear.py: column- and row-parallel projections, the vocab-parallel embedding and head)."""
