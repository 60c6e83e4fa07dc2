"""Tiny Transformers checkpoints of the families in ster_dist/families/classic.py (entries as in tests/tiny_models.py)."""

from __future__ import annotations

TINY_CLASSIC: dict[str, tuple[str, str, dict]] = {
    # adjacent pairs rotating over half of each 12-wide head
    "gptj": ("GPTJConfig", "GPTJForCausalLM", dict(n_inner=80, rotary_dim=6)),
    # multi-query (one key-value head) and multi-head; n_head is given by its own name, as the config derives
    # num_key_value_heads from it before the attribute map would set it
    "gpt_bigcode": ("GPTBigCodeConfig", "GPTBigCodeForCausalLM", dict(n_head=4, n_inner=80, multi_query=True)),
    "gpt_bigcode_mha": ("GPTBigCodeConfig", "GPTBigCodeForCausalLM", dict(n_head=4, n_inner=80, multi_query=False,
                                                                          tie_word_embeddings=False)),
    "opt": ("OPTConfig", "OPTForCausalLM", dict(ffn_dim=80)),
    # the new decoder architecture: grouped key-value heads, ln_attn and ln_mlp
    "falcon": ("FalconConfig", "FalconForCausalLM", dict(new_decoder_architecture=True, num_kv_heads=2,
                                                         ffn_hidden_size=80, bias=False)),
    # Falcon-7B: multi-query, one norm before a parallel block
    "falcon_mq": ("FalconConfig", "FalconForCausalLM", dict(multi_query=True, parallel_attn=True,
                                                            ffn_hidden_size=80, bias=False)),
    # Falcon-RW: ALiBi, sequential blocks, every head its own key and value, biased
    "falcon_alibi": ("FalconConfig", "FalconForCausalLM", dict(alibi=True, multi_query=False, parallel_attn=False,
                                                               ffn_hidden_size=80, bias=True)),
    # six heads: ALiBi slopes of a head count that is not a power of two
    "bloom": ("BloomConfig", "BloomForCausalLM", dict(num_attention_heads=6)),
    "mpt": ("MptConfig", "MptForCausalLM", dict(max_seq_len=128)),
}
# variant name -> family, for variants not named after their family
VARIANT_FAMILY_CLASSIC: dict[str, str] = {"gpt_bigcode_mha": "gpt_bigcode", "falcon_mq": "falcon",
                                          "falcon_alibi": "falcon"}
# keys of tests/tiny_models._BASE these configs do not take (each states its own width key)
UNSTATED_BASE_CLASSIC: dict[str, tuple[str, ...]] = {
    **{v: ("intermediate_size",) for v in ("gptj", "opt", "falcon", "falcon_mq", "falcon_alibi", "bloom")},
    **{v: ("intermediate_size", "num_attention_heads") for v in ("gpt_bigcode", "gpt_bigcode_mha")},
    "mpt": ("intermediate_size", "max_position_embeddings"),
}
