"""LongCat-Flash (Meituan): DeepSeek's latent attention in stored layers that each run as two
decoder layers, with shortcut-connected experts between them.

- longcat_flash: stored layer k (num_layers of them) is decoder layers 2k and 2k + 1
  (FamilySpec.halved_layers), so --layer, hook sites and the key-value cache count halves. Half h is
  input_layernorm.{h}, latent attention self_attn.{h} rotating adjacent pairs,
  post_attention_layernorm.{h} and a dense mlps.{h} ffn_hidden_size wide. Beside them, the experts
  (model/shortcut.py) read the first half's feed-forward input and join the residual at the end of
  the second: mlp.router.classifier scores n_routed_experts experts expert_ffn_hidden_size wide and
  zero_expert_num identity experts by softmax, mlp.router.e_score_correction_bias moves the choice
  of moe_topk, and the chosen weights are multiplied by routed_scaling_factor (no renormalisation);
  an identity expert returns its input (moe/layer.py). Under mla_scale_q_lora and mla_scale_kv_lora
  (Transformers applies both whatever the config says, so an unstated switch is on) the query and
  the normed latent are multiplied by sqrt(hidden_size / q_lora_rank) and sqrt(hidden_size /
  kv_lora_rank) (model/mla.py). The multi-token-prediction tensors (model.mtp.*) are never read. No
  adapter is trained on it (families/adapter_rules.py).
- longcat_flash_ngram (LongCat-Flash-Lite): longcat_flash with hashed n-gram embeddings beside the
  token embedding (model/ngram_embedding.py); a config naming only LongcatFlashNgramForCausalLM in
  architectures is read as it (config_file.py). For orders 2 .. emb_neighbor_num and emb_split_num
  tables each, table index = (order - 2) * emb_split_num + j is ngram_vocab_size_ratio * vocab_size
  + 2 * index + 1 rows tall (model.ngram_embeddings.embedders.{index}) and hidden_size /
  (emb_split_num * (emb_neighbor_num - 1)) wide, as vLLM's and mlx-lm's implementations build it
  (the seed states no width); its post projection (model.ngram_embeddings.post_projs.{index},
  [hidden, width]) has no bias. Runs restart after each of the config's eos_token_id. The token
  embedding may also be stored as model.ngram_embeddings.word_embeddings. No adapter is trained on
  it.
"""

from __future__ import annotations

from ster_dist.families.layouts import weight_and_bias
from ster_dist.families.normalize import ConfigProblem, stated, with_defaults
from ster_dist.families.spec import AttentionSpec, FamilySpec, MoESpec, PositionSpec, Rule

_LAYER = "model.layers.{i}"
# what LongcatFlashConfig assumes where a config is silent
_DEFAULTS = {
    "num_layers": 28,
    "ffn_hidden_size": 12288,
    "expert_ffn_hidden_size": 2048,
    "n_routed_experts": 512,
    "zero_expert_num": 256,
    "moe_topk": 12,
    "routed_scaling_factor": 6.0,
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "rms_norm_eps": 1e-5,
    "mla_scale_q_lora": True,
    "mla_scale_kv_lora": True,
}


def _longcat_flash(raw: dict) -> dict:
    raw = with_defaults(raw, _DEFAULTS)
    layers = raw["num_layers"]
    if isinstance(layers, bool) or not isinstance(layers, int) or layers < 1:
        raise ConfigProblem(
            f"num_layers is {layers!r}: state the stored layer count, a positive integer"
        )
    kind = stated(raw, "zero_expert_type", default="identity")
    if kind != "identity":
        raise ConfigProblem(
            f"zero_expert_type is {kind!r}; only identity zero experts are supported"
        )
    if stated(raw, "router_bias", default=False):
        raise ConfigProblem(
            "router_bias is true; a biased router classifier is not supported; set it to false"
        )
    return {
        **raw,
        "num_hidden_layers": 2 * layers,
        "intermediate_size": raw["ffn_hidden_size"],
        "moe_intermediate_size": raw["expert_ffn_hidden_size"],
        "num_experts_per_tok": raw["moe_topk"],
        "head_dim": None,
        "mlp_layer_types": ["dense"] * (2 * layers),
        "scoring_func": "softmax",
        "topk_method": "greedy",
        "norm_topk_prob": False,
        "mlp_bias": False,
        "shortcut_experts": True,
        "mla_scale_q_lora": bool(raw["mla_scale_q_lora"]),
        "mla_scale_kv_lora": bool(raw["mla_scale_kv_lora"]),
    }


def _longcat_flash_ngram(raw: dict) -> dict:
    out = _longcat_flash(raw)
    stated = {
        key: raw.get(key) for key in ("emb_neighbor_num", "emb_split_num", "ngram_vocab_size_ratio")
    }
    for key, value in stated.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise ConfigProblem(
                f"{key} is {value!r}: LongCat-Flash-Lite's n-gram embedding needs it stated, a "
                f"positive number"
            )
    neighbors, splits = stated["emb_neighbor_num"], stated["emb_split_num"]
    if not isinstance(neighbors, int) or not isinstance(splits, int) or neighbors < 2:
        raise ConfigProblem(
            f"emb_neighbor_num {neighbors!r} and emb_split_num {splits!r}: state integers, "
            f"emb_neighbor_num at least 2"
        )
    vocab = out.get("vocab_size")
    if isinstance(vocab, bool) or not isinstance(vocab, int) or vocab < 1:
        raise ConfigProblem(
            f"vocab_size is {vocab!r}: the n-gram hash needs it stated, a positive integer"
        )
    base = stated["ngram_vocab_size_ratio"] * vocab
    eos = raw.get("eos_token_id")
    breaks = [] if eos is None else list(eos) if isinstance(eos, list) else [eos]
    rows = [int(base + 2 * index + 1) for index in range(splits * (neighbors - 1))]
    return {**out, "ngram_embedding": {"neighbors": neighbors, "rows": rows, "breaks": breaks}}


def _rules() -> tuple[Rule, ...]:
    rules: list[Rule] = [
        Rule("model.embed_tokens.weight", "embed.weight"),
        *weight_and_bias("lm_head", "lm_head"),
        *weight_and_bias("model.norm", "final_norm"),
    ]
    for name, target in (
        ("input_layernorm", "attn_norm"),
        ("post_attention_layernorm", "mlp_norm"),
    ):
        rules.append(Rule(f"{_LAYER}.{name}.{{half}}.weight", f"layers.{{i}}.{target}.weight"))
    for name, target in (
        ("q_a_proj", "q_a"),
        ("q_a_layernorm", "q_a_norm"),
        ("q_b_proj", "q_b"),
        ("q_proj", "q"),
        ("kv_a_proj_with_mqa", "kv_a"),
        ("kv_a_layernorm", "kv_a_norm"),
        ("kv_b_proj", "kv_b"),
        ("o_proj", "o"),
    ):
        rules += weight_and_bias(
            f"{_LAYER}.self_attn.{{half}}.{name}", f"layers.{{i}}.attn.{target}"
        )
    for name, target in (("gate_proj", "gate"), ("up_proj", "up"), ("down_proj", "down")):
        rules.append(
            Rule(f"{_LAYER}.mlps.{{half}}.{name}.weight", f"layers.{{i}}.mlp.{target}.weight")
        )
        # the shortcut experts, held by the stored layer's first half
        rules.append(
            Rule(
                f"{_LAYER}.mlp.experts.{{e}}.{name}.weight",
                f"layers.{{i}}.shortcut.experts.{target}",
            )
        )
    rules += [
        Rule(f"{_LAYER}.mlp.router.classifier.weight", "layers.{i}.shortcut.router.weight"),
        Rule(
            f"{_LAYER}.mlp.router.e_score_correction_bias", "layers.{i}.shortcut.router.correction"
        ),
    ]
    return tuple(rules)


# the token embedding is model.embed_tokens or, where a release names it inside the n-gram module as
# vLLM's
# FlashNgramModel registers it, model.ngram_embeddings.word_embeddings
_NGRAM_RULES = (
    Rule("model.ngram_embeddings.word_embeddings.weight", "embed.weight"),
    Rule("model.ngram_embeddings.embedders.{s}.weight", "ngram.embedders.{s}.weight"),
    Rule("model.ngram_embeddings.post_projs.{s}.weight", "ngram.post_projs.{s}.weight"),
)


LONGCAT_FAMILIES: tuple[FamilySpec, ...] = (
    FamilySpec(
        "longcat_flash",
        _rules(),
        attention=AttentionSpec(latent=True),
        positions=PositionSpec(interleaved=True, theta=10000000.0),
        normalize=_longcat_flash,
        moe=MoESpec(scaling="always", correction_bias=True),
        halved_layers=True,
        ignore=(r"model\.mtp\..*",),
        parity_reference="LongcatFlashForCausalLM",
    ),
    FamilySpec(
        "longcat_flash_ngram",
        _rules() + _NGRAM_RULES,
        attention=AttentionSpec(latent=True),
        positions=PositionSpec(interleaved=True, theta=10000000.0),
        normalize=_longcat_flash_ngram,
        moe=MoESpec(scaling="always", correction_bias=True),
        halved_layers=True,
        ignore=(r"model\.mtp\..*",),
        parity_reference="tests/families/test_longcat_ngram.py",
    ),
)
