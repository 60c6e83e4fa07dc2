"""Building blocks shared by the dense decoder (model/) and the experts (moe/), below both:
activations (activation.py) and the tensor-parallel feed-forward (mlp.py)."""
