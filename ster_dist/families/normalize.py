"""Config normalisation: the generic keys config.from_hf reads, and the helpers family normalisers
share.

A family's `normalize(raw) -> raw` (FamilySpec.normalize) returns a new dict in which the keys below
mean what this table says, whatever the family itself calls them: it renames the family's own keys,
fills what its Transformers config class assumes where a config is silent, and fixes what the family
never reads from its config. from_hf reads these keys for every family, so a family whose config
class holds one with another meaning (or which Transformers ignores) sets it here. A key that is
unstated (missing or null) after normalisation takes the default in the right-hand column.
Sizes, epsilons, rotations, multipliers and the MoE counts keep Transformers' usual names
(hidden_size, rms_norm_eps, rope_parameters, ...) and the aliases config.py lists.
"""

from __future__ import annotations

GENERIC_KEYS: dict[str, str] = {
    "attention_bias": "the query, key and value projections are biased (and the output one, unless "
    "attention_out_bias says otherwise); default false",
    "attention_out_bias": "the attention output projection is biased; default: attention_bias",
    "mlp_bias": "the dense feed-forward's projections are biased; default false",
    "mlp_down_bias": "the dense feed-forward's down projection is biased; default: mlp_bias (TeleChat biases it "
    "alone)",
    "lm_head_bias": "the head is biased; default false",
    "use_qk_norm": "the family's query/key norms (AttentionSpec.qk_norm) are applied; default true",
    "use_post_norm": "a norm over each sublayer's output; default NormSpec.post",
    "use_parallel_residual": "attention and feed-forward read the same input; default NormSpec.parallel",
    "num_ln_in_parallel_attn": "a parallel block's norms: 1 shared, any other number one per half; "
    "default NormSpec.parallel_shared",
    "norm_kind": 'the block and final norms: "rms" or "layer"; default NormSpec.kind',
    "multi_query": "one key-value head, whatever count is stated; default false",
    "alibi": 'ALiBi in place of learned or rotated positions; default PositionSpec.kind == "alibi"',
    "dense_layers_rotate": 'under PositionSpec.layers "sliding", layers with a dense feed-forward in an '
    "MoE model rotate too; default false",
    "dense_intermediate_size": "the dense feed-forward's width where intermediate_size is the experts'; "
    "default intermediate_size",
    "scoring_func": 'the router\'s scores: "softmax" or "sigmoid"; default MoESpec.scoring',
    "shared_expert_combination_strategy": '"average" halves routed plus shared experts\' output, "sum" '
    'keeps it; default "sum"',
    "post_mlp_norm_sparse_only": "a norm over the feed-forward's output on the layers with experts only, whatever "
    "use_post_norm says (A.X-K1); default false",
    "post_norm_eps": "the epsilon of the norms over each sublayer's output (Muse Glimmer); default rms_norm_eps",
    "residual_factors": "per layer, [mixer alpha, mixer beta, feed-forward alpha, feed-forward beta]: each "
    "sublayer joins the residual as residual * alpha + output * beta (MiniMax); default none",
    "residual_from_norm": "the residual a sublayer joins is its normed input (MiniMax's postnorm); default false",
    "block_skips": "block skip connections: per skip [layers before which the hidden state is kept, layers "
    "before which it becomes w * kept + (1 - w) * hidden, w] (Solar Pro); default none",
    "mlp_multipliers": "two numbers scaling the dense feed-forward's gate output (before its activation) and its "
    "output (Falcon-H1's muP); default [1, 1]",
    "loop_layers": "a looped model's stored layer count, which its layers repeat over (num_hidden_layers then "
    "counts every pass's layers: Nanbeige); default 0, not looped",
    "loop_pass_norm": "a looped model's final norm closes every pass, not only the last; default false",
    "loop_schedule": "a looped model of several stacks: per pass [stack, the state it replaces, the states it "
    "reads summed] (HRM-Text); default every pass stack 0 on state 0",
    "bidirectional_prompt": "a prompt read whole from position zero attends both ways within itself, later "
    "tokens causally (HRM-Text's prefix_lm); default false",
    "rotate_adjacent_pairs": "each head's rotated dimensions turn as adjacent pairs rather than halves (ChatGLM's "
    "original_rope); default PositionSpec.interleaved",
    "query_temperature_beta": "Llama 4's query temperature: queries times 1 + beta * ln(1 + floor((position + "
    "query_temperature_offset) / query_temperature_length)); default none (Ministral 3 "
    "states it in rope_parameters' llama_4_scaling_beta)",
    "query_temperature_length": "the positions one step of the query temperature spans; needed with its beta",
    "query_temperature_offset": "added to a query's position before the temperature counts it; default 0",
    "query_temperature_layers": "per layer, 0 or 1: which layers scale their queries by the temperature; "
    "default every layer",
    "qk_norm_layers": "per layer, 0 or 1: which layers apply the family's query/key norms; default every layer",
    "layer_heads": "per layer, its query head count, where layers differ (Laguna); default num_attention_heads",
    "layer_kv_heads": "per layer, its key-value head count, where layers differ (MiMo-V2-Flash); default "
    "num_key_value_heads",
    "layer_intermediate_size": "per layer, its dense feed-forward's width, where layers differ (DeciLM); default "
    "intermediate_size",
    "norm_groups": "the hidden-width RMS norms normalise this many equal groups of the width apart before the "
    "stored scale (K2-Horizon's layernorm_num_groups); default 1",
    "output_gate_func": '"silu" or "softplus_ln2": attention\'s output, channel by channel, times that '
    "function (log2(1 + 2^g) for the latter) of self_attn.gate_proj's logit before the output "
    'projection (K2-Horizon); default "none"',
    "value_expert_keys": "the keys (num_experts, num_experts_per_tok) K2-Horizon's value experts state over the "
    "experts': on the layers with experts each value is their routed sum (MoVA); default none",
    "value_head_dim": "the value heads' width where it differs from head_dim (MiMo-V2-Flash); default head_dim",
    "query_bottleneck": "the width each query narrows to (and is RMS-normed at) before q widens it to every head, "
    "on the layers of the bottleneck_attention kind (Step3's share_q_dim); default none",
    "attention_value_scale": "every value multiplied by this before attention (MiMo-V2-Flash); default 1",
    "layer_head_dim": "per layer, its query and key heads' width, where layers differ (Gemma 4); default head_dim",
    "value_from_key_layers": "per layer, 0 or 1: which layers have no value projection, the value being the key "
    "projection before its norm (Gemma 4's attention_k_eq_v); default none",
    "layer_scalar": "each layer's output times its stored layer_scalar (Gemma 4); default false",
    "per_layer_input_size": "the width of each layer's own input (Gemma 4's hidden_size_per_layer_input); default "
    "0, none",
    "per_layer_input_vocab": "the rows of the per-layer inputs' token table; default vocab_size",
    "sink_layers": "per layer, 0 or 1: which layers carry a learned sink per head; default AttentionSpec.sinks "
    "everywhere",
    "softplus_output_gate": '"head" or "element": each head\'s output times the softplus of the gate '
    "projection's logit for the head (or channel) before the output projection (Laguna); "
    'default "none"',
    "sigmoid_head_gate": "each head's output times the sigmoid of its own logit of the gate projection, before "
    "the output projection (Step 3.5's g_proj); default false",
    "glu_limit_layers": "per layer, L of min(act(gate), L) * clamp(up, -L, L) in the routed experts, 0 for none "
    "(Step 3.5's swiglu_limits); default none",
    "shared_glu_limit_layers": "per layer, the same bound in the shared experts' feed-forward (Step 3.5's "
    "swiglu_limits_shared); default none",
    "scored_vocab_size": "only the first this many tokens are scored, the head's rows past them being padding "
    "(Inkling's unpadded_vocab_size); default: every row",
    "sublayer_conv_kernel": "attention's and the feed-forward's outputs each pass a residual short convolution "
    "of this kernel width (Inkling); default none",
    "mlp_output_scale": "the dense feed-forward's output times a stored scale (Inkling's global_scale); default "
    "false",
    "word_embed_proj_dim": "the embedding's width, which must equal hidden_size (no projection in and out)",
    "value_norm": "a scale-free RMS norm over each value head (Gemma 3n, Gemma 4); default false",
    "swiglu_oai": "[limit, alpha]: dense and shared feed-forwards are SwiGLU-OAI (MiniMax-M3); default none",
    "kv_source_layers": "per layer, null or the earlier layer whose keys and values it attends, making none of its "
    "own (num_kv_shared_layers of Gemma 3n and Gemma 4, shared_kv_sources); default: every "
    "layer its own",
    "gate_sparsity_layers": "per layer, p in [0, 1): where above 0, the dense feed-forward's gate keeps only what "
    "lies above its mean plus Phi^-1(p) deviations (Gemma 3n); default none",
    "laurel_rank": "the width of Laurel's low-rank residual beside attention (Gemma 3n); default 0, none",
    "ngram_embedding": "{neighbors, rows, breaks}: hashed n-gram embedding tables averaged with the token's "
    "(config_ngram.py, LongCat-Flash-Lite); default none",
    "hyper_streams": "the residual as this many hyper-connected streams, read with hyper_mixing, hyper_eps, "
    "hyper_post_scale, hyper_post_eps, hyper_sinkhorn_iters and hyper_head (model/hyper_connection"
    ".py: HY V4, DeepSeek-V4); default 0, one residual",
}
# the spellings of a key-value head count config.py reads
KV_HEAD_KEYS = ("num_key_value_heads", "num_kv_heads", "kv_n_heads", "n_head_kv")


class ConfigProblem(Exception):
    """A value a normaliser cannot read: one line naming the key and the fix. from_hf refuses it
    with the config's path (normalisers see the config, not where it came from)."""


def stated(raw: dict, *names: str, default=None):
    """The first of `names` the config states (null is unstated), else default."""
    for name in names:
        if raw.get(name) is not None:
            return raw[name]
    return default


def with_defaults(raw: dict, defaults: dict) -> dict:
    """raw over what the family's Transformers config class assumes for keys a config leaves out (a
    stated null stays null, as Transformers reads it)."""
    return {**defaults, **raw}


def defaults(values: dict):
    """A normaliser that only fills the family's Transformers class defaults."""
    return lambda raw: with_defaults(raw, values)


def shared_kv_sources(kinds: list, shared: int) -> list[int | None]:
    """kv_source_layers for num_kv_shared_layers (Gemma 3n, Gemma 4): each of the last `shared`
    layers attends the keys and values of the last earlier layer of its own kind (`kinds`: the
    layer_types), None for a layer with its own."""
    first = len(kinds) - shared
    sources: list[int | None] = [None] * len(kinds)
    for i in range(max(first, 0), len(kinds)):
        makers = [j for j in range(first) if kinds[j] == kinds[i]]
        if not makers:
            raise ConfigProblem(
                f"num_kv_shared_layers {shared} leaves no earlier {kinds[i]} layer for layer {i} to "
                "share keys and values with; state fewer shared layers"
            )
        sources[i] = makers[-1]
    return sources


def biases(raw: dict, attention: bool, out: bool | None = None, mlp: bool = False) -> dict:
    """raw with every projection's bias fixed by the family: the attention's (its output's too
    unless `out` differs) and the feed-forward's."""
    return {
        **raw,
        "attention_bias": attention,
        "attention_out_bias": attention if out is None else out,
        "mlp_bias": mlp,
    }


def always_biased(raw: dict) -> dict:
    """Every projection biased, with no config key to turn the biases off (GPT-2, BLOOM, Phi)."""
    return biases(raw, True, mlp=True)


def never_biased(raw: dict) -> dict:
    """No projection biased, whatever the config says (Gemma, Phi-3, MPT)."""
    return biases(raw, False)


def biases_from(raw: dict, key: str, default: bool = False, head: bool = False) -> dict:
    """Every projection's bias (and the head's too when `head`) switched by one config key of the
    family's own (StarCoder2 and ERNIE's use_bias, Falcon's bias, OPT's enable_bias)."""
    on = bool(stated(raw, key, default=default))
    out = biases(raw, on, mlp=on)
    return {**out, "lm_head_bias": on} if head else out


def switch(raw: dict, key: str) -> bool:
    """A family's own on/off key, off when unstated (after its defaults are filled)."""
    return bool(stated(raw, key, default=False))
