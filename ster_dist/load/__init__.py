"""Loading a model on one rank: ModelConfig -> the decoder built on the meta device -> filled from
its checkpoint shard by shard (model_loader.py); a model's MTP layer on a rank that holds the model
(mtp.py); and tiny random checkpoints with a real tokenizer (toy.py).
"""

from ster_dist.load.model_loader import (  # noqa: F401  the package's public names
    LoadedModel,
    PRECISIONS,
    check_device,
    check_expert_parallel,
    check_weights,
    compute_dtype,
    load_decoder,
    load_model,
    open_source,
)
