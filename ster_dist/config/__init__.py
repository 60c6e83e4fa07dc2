"""What a model is, read from its config.json before any weight: ModelConfig (model.py) and the
readers of each section (rope, moe, quant, layers, ...), the value ranges checked first (ranges.py),
and the file level: the architecture gate, text wrappers, Mistral's params.json (file.py,
params.py).
"""

from ster_dist.config.model import (  # noqa: F401  the package's public names
    ACTIVATIONS,
    ATTENTION_MIXERS,
    FEED_FORWARD_KINDS,
    MIXER_KINDS,
    MoEConfig,
    ModelConfig,
    RopeConfig,
    from_hf,
)
