"""LoRA adapters: PEFT's and Ster's formats (format.py), their targets mapped onto the decoder
and the checkpoint through the family name map (targets.py), streaming merges (merge.py) and
runtime attachment across tensor-parallel ranks (attach.py)."""
