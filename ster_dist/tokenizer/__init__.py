"""A checkpoint's tokenizer: tokenizer.json or the formats read in its place (files.py), the class
Transformers would build (classes.py), and chat templates rendered under limits (chat_template.py,
template_limits.py).
"""

from ster_dist.tokenizer.tokenizer import (  # noqa: F401  the package's public names
    CHAT_TEMPLATE_MODES,
    Tokenizer,
)
