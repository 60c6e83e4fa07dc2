"""ModelConfig: one frozen, normalised view of a checkpoint's config.json.

This is the only code that reads config keys. A family's normalisation
(FamilySpec.normalize) first puts its own names and its Transformers class's
defaults into the generic keys families/normalize.py lists; this reader then
resolves every alias the families share (GPT-style n_embd / n_layer / n_head,
the five norm-epsilon spellings, Transformers 5's rope_parameters, layer_types,
...) and turns the family's conventions (its FamilySpec's sub-specs) into plain
switches, so the decoder reads switches and sizes and never a family name.
Its rotation part is config_rope.py, its experts part config_moe.py, its
per-layer tables config_layers.py, and config_keys.Keys the aliased lookup
they all read through.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from ster_dist.config import layers as per_layer
from ster_dist.config.altup import AltUpConfig, altup_config
from ster_dist.config.file import family_of, not_runnable, text_config, wrapper_of
from ster_dist.config.keys import Keys
from ster_dist.config.moe import MoEConfig, moe_config
from ster_dist.config.ngram import NgramConfig, ngram_config
from ster_dist.config.quant import Quantization, quantization
from ster_dist.config.ranges import FIX, check_sizes, check_stated
from ster_dist.config.rope import RopeConfig, rotations, yarn_mscale
from ster_dist.errors import Refusal
from ster_dist.families.normalize import KV_HEAD_KEYS, ConfigProblem
from ster_dist.families.registry import spec_for
from ster_dist.families.spec import FamilySpec, QKNormSpec

ACTIVATIONS = (
    "silu",
    "gelu",
    "gelu_pytorch_tanh",
    "gelu_new",
    "gelu_fast",
    "relu2",
    "relu",
    "gelu_exact",
    "xielu",
)


@dataclass(frozen=True)
class MLAConfig:
    """Multi-head latent attention sizes (DeepSeek-V2/V3, MiniCPM3)."""

    q_lora_rank: int | None  # None: one q_proj without a query bottleneck
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int


# the layer kinds a config may pick (model/kinds.py builds them); attention kinds keep keys per
# position
# "attention_mamba2": attention and Mamba-2 side by side (Falcon-H1), keeping keys as well as a
# state
# "inkling_attention": Inkling's attention (a distance bias mixed per query, short convolutions over
# keys and
# values), keeping keys as well as its convolutions' windows
# "bottleneck_attention": attention whose query passes a narrow normed projection first (Step3)
ATTENTION_MIXERS = (
    "attention",
    "latent_attention",
    "attention_mamba2",
    "inkling_attention",
    "loop_attention",
    "bottleneck_attention",
    "block_sparse_attention",
    "compressed_attention",
)
# "none": a layer of the feed-forward alone (Nemotron-H's "-" and "E" layers);
# "mamba2_shared_block": a Mamba-2
# layer fed by a transformer block several layers share (Zamba2's hybrid layers)
MIXER_KINDS = ATTENTION_MIXERS + (
    "mamba",
    "mamba2",
    "gated_delta",
    "kimi_delta",
    "lightning",
    "short_conv",
    "none",
    "mamba2_shared_block",
)
# the kinds whose layer attends, so head sizes and rotations apply to it
ATTENDING_MIXERS = ATTENTION_MIXERS + ("mamba2_shared_block",)
# "dense_and_moe": experts beside a dense feed-forward, both reading the residual (Gemma 4's
# enable_moe_block)
FEED_FORWARD_KINDS = ("dense", "moe", "none", "dense_and_moe")
ROUTED_FEED_FORWARDS = ("moe", "dense_and_moe")


@dataclass(frozen=True)
class ModelConfig:
    family: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    max_position: int
    # per-layer attention sizes where layers differ (MiMo-V2-Flash's key-value heads, Laguna's query
    # heads);
    # empty: num_heads / num_kv_heads in every layer
    layer_heads: tuple[int, ...] = ()
    layer_kv_heads: tuple[int, ...] = ()
    # each layer's dense feed-forward width where layers differ (DeciLM)
    layer_intermediate: tuple[int, ...] = ()
    # value heads narrower than query/key heads (MiMo-V2-Flash); None: head_dim
    value_head_dim: int | None = None
    # the width queries narrow to before q (Step3's share_q_dim); None: none
    query_bottleneck: int | None = None
    # per layer, the bound of min(act(gate), L) * clamp(up, +-L) in the routed experts and in the
    # shared or dense
    # feed-forward (Step 3.5's swiglu_limits, swiglu_limits_shared); 0: unclamped; empty: none
    # anywhere
    layer_glu_limits: tuple[float, ...] = ()
    layer_shared_glu_limits: tuple[float, ...] = ()
    # every value multiplied by this before attention (MiMo-V2-Flash)
    value_scale: float = 1.0
    # per layer, its heads' width where layers differ (Gemma 4); empty: head_dim
    layer_head_dim: tuple[int, ...] = ()
    # per layer, whether it has no value projection, its value being the key projection before any
    # norm (Gemma 4's
    # attention_k_eq_v on full layers); empty: none
    layer_value_from_key: tuple[bool, ...] = ()
    # a scale-free RMS norm over each value head (Gemma 3n, Gemma 4)
    value_norm: bool = False
    # (limit, alpha): dense and shared feed-forwards are SwiGLU-OAI (MiniMax-M3)
    swiglu_oai: tuple[float, ...] = ()
    # per layer, the earlier layer whose keys and values it attends, None for its own (Gemma 3n's
    # and Gemma 4's
    # num_kv_shared_layers, which their normalisers turn into kv_source_layers); empty: its own
    layer_kv_source: tuple[int | None, ...] = ()
    # each layer's output times its stored layer_scalar (Gemma 4)
    layer_scalar: bool = False
    # per-layer inputs (Gemma 4's E models, model/per_layer_input.py): each layer's input width, 0
    # for none, and
    # the vocabulary of their token table
    per_layer_input: int = 0
    per_layer_vocab: int = 0
    # norms
    norm_kind: str = "rms"  # "rms" | "layer"
    # hidden-width RMS norms over this many equal groups apart (K2-Horizon)
    norm_groups: int = 1
    norm_bias: bool = False
    norm_eps: float = 1e-6
    norm_offset: float = 0.0  # 1.0 where the stored scale is an offset from one (Gemma)
    post_norm_offsets: tuple[float, float] | None = None  # the post norms' own offsets (PLaMo 3)
    # False: the block and final norms have no scale or bias (OLMo 1)
    norm_affine: bool = True
    norm_scale_f32: bool = False  # RMS norms apply their scale in f32, then cast (Gemma 3n)
    # block layout
    pre_attn_norm: bool = True
    pre_mlp_norm: bool = True
    post_attn_norm: bool = False  # a norm over the attention output (Gemma 2, OLMo 2)
    post_mlp_norm: bool = False
    # per layer, whether the feed-forward's output is normed where that differs by layer (A.X-K1:
    # only the layers
    # with experts); empty: post_mlp_norm on every layer
    post_mlp_norm_layers: tuple[bool, ...] = ()
    parallel_block: bool = False  # attention and feed-forward read the same input
    parallel_shared_norm: bool = True  # one norm feeds both halves of a parallel block
    # attention
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: str = "none"  # "none" | "head" (per head) | "proj" (whole projection)
    qk_norm_kind: str = "rms"  # "rms" | "layer"
    qk_norm_per_head_weight: bool = False  # a separate scale per head ([heads, head_dim])
    qk_norm_bias: bool = False
    # per-head query/key norms after the rotation rather than before (HunYuan)
    qk_norm_after_rope: bool = False
    # False: the query/key norms have no scale (Llama 4's L2 norm, Muse Glimmer)
    qk_norm_affine: bool = True
    # which layers norm queries and keys (Llama 4: rotating ones); empty: all
    layer_qk_norm: tuple[bool, ...] = ()
    # q_proj yields each head's query rows and then as many gate rows; the attention output is
    # multiplied by
    # the gate's sigmoid before o_proj (Qwen3-Next, Qwen3.5: a config's attn_output_gate, which
    # their
    # normalisation states)
    attn_output_gate: bool = False
    # Laguna's g_proj: each head's output times the softplus of its own logit ("head") or of one per
    # channel
    # ("element"), before o_proj; "none": no such gate
    softplus_gate: str = "none"
    # Step 3.5's g_proj: each head's output times the sigmoid of its own logit
    sigmoid_head_gate: bool = False
    # K2-Horizon's gate_proj: each output channel times silu or log2(1 + 2^g) of its own logit
    # ("silu" |
    # "softplus_ln2"); "none": no such gate
    output_gate: str = "none"
    # Llama 4's query temperature (Ministral 3): queries times 1 + beta * ln(1 + floor((position +
    # offset) /
    # length)), in the layers layer_query_temperature marks (empty: every layer)
    query_temperature_beta: float = 0.0
    query_temperature_length: int | None = None
    query_temperature_offset: int = 0
    layer_query_temperature: tuple[bool, ...] = ()
    attn_scale: float = 1.0
    attn_softcap: float | None = None
    clip_qkv: float | None = None
    layer_rope: tuple[RopeConfig | None, ...] = ()  # None: the layer does not rotate
    layer_window: tuple[int | None, ...] = ()  # sliding window per layer, None = full
    # attention by chunks per layer (Llama 4): a query sees the keys of its own chunk of this many
    # positions
    layer_chunk: tuple[int | None, ...] = ()
    learned_positions: bool = False
    position_offset: int = 0
    # ALiBi: each head adds slope x the key's absolute position to its scores (slopes by global head
    # index)
    alibi: bool = False
    alibi_before_scale: bool = False  # added before the scores are scaled (Falcon)
    alibi_bf16: bool = False  # slopes and bias rounded to bf16 (Falcon)
    # the bias is -slope x sqrt(query position - key position) (Step1)
    alibi_sqrt: bool = False
    embed_norm: bool = False  # a norm after the token embedding (BLOOM)
    embed_norm_affine: bool = True  # False: that norm has no scale (Muse Glimmer)
    # the final norm's offset from one where it differs (None: norm_offset)
    final_norm_offset: float | None = None
    # the norms over each sublayer's output at their own epsilon (None: norm_eps)
    post_norm_eps: float | None = None
    # feed-forward
    mlp_gated: bool = True
    hidden_act: str = "silu"
    mlp_up_bias: bool = False
    mlp_down_bias: bool = False
    # the gate's output and the feed-forward's (Falcon-H1's muP)
    mlp_multipliers: tuple[float, float] = (1.0, 1.0)
    # per layer, p: the gate keeps only what lies above its mean plus Phi^-1(p) standard deviations
    # where p > 0
    # (Gemma 3n's activation sparsity); empty: no layer
    layer_gate_sparsity: tuple[float, ...] = ()
    # Gemma 3n: AltUp's copies of the hidden state with per-layer inputs (config_altup.py), and the
    # width of
    # Laurel's low-rank residual beside attention (0: none)
    altup: AltUpConfig | None = None
    laurel_rank: int = 0
    # hashed n-gram embeddings beside the token's (config_ngram.py)
    ngram: NgramConfig | None = None
    # embedding and head
    embed_scale: float = 1.0
    residual_multiplier: float = 1.0
    # the residual stream kept in f32 while the layers compute in the model's dtype (Mamba's
    # residual_in_fp32)
    residual_fp32: bool = False
    # the residual as this many streams (model/hyper_connection.py); 0: one
    hyper_streams: int = 0
    # recurrent layers run pre-norm (norm before each sublayer) in an otherwise post-norm family
    # (OLMo Hybrid)
    recurrent_pre_norm: bool = False
    # each sublayer joins the residual as residual * alpha + output * beta: (mixer alpha, mixer
    # beta,
    # feed-forward alpha, feed-forward beta) per layer (MiniMax); empty: plain sums
    residual_factors: tuple[tuple[float, float, float, float], ...] = ()
    # the residual a sublayer joins is its normed input rather than its input (MiniMax's postnorm)
    residual_from_norm: bool = False
    # block skip connections (Solar Pro), per slot: (layers before which the hidden state is kept,
    # layers before
    # which it becomes w * kept + (1 - w) * hidden, w); every slot keeps before any mixes at the
    # same layer
    block_skips: tuple[tuple[tuple[int, ...], tuple[int, ...], float], ...] = ()
    logit_multiplier: float = 1.0
    # only the first scored_vocab tokens are scored; the head's rows past them are padding
    # (Inkling's
    # unpadded_vocab_size); None: every row
    scored_vocab: int | None = None
    # attention's and the feed-forward's outputs each pass a residual short convolution of this
    # kernel width
    # before joining the residual stream, continued across steps (Inkling's attn_sconv, mlp_sconv);
    # 0: none
    sublayer_conv: int = 0
    # the dense feed-forward's output times a stored scale (Inkling's mlp.global_scale)
    mlp_output_scale: bool = False
    logit_softcap: float | None = None
    tie_word_embeddings: bool = False
    lm_head_bias: bool = False
    # tokens
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None
    torch_dtype: str | None = None
    # mixture of experts, latent attention, sinks
    moe: MoEConfig | None = None
    # which layers route over experts (the rest keep the dense MLP)
    moe_layers: tuple[bool, ...] = ()
    # a layer's own experts where the config states them per layer (Nemotron Puzzle); None: `moe`
    layer_moe: tuple[MoEConfig | None, ...] = ()
    # K2-Horizon's MoVA: on the layers with experts, each value is the weighted sum of value
    # experts' SiLU outputs,
    # routed like this (num_experts, top_k, scores, choice); None: a value projection everywhere
    value_experts: MoEConfig | None = None
    mla: MLAConfig | None = None
    # a layer's own latent sizes where they differ from `mla` (Dots3-Note's sliding layers); None:
    # `mla`
    layer_mla: tuple[MLAConfig | None, ...] = ()
    # a learned extra logit per head whose share is dropped (GPT-OSS)
    attn_sinks: bool = False
    # which layers have sinks (MiMo-V2-Flash: sliding ones); empty: attn_sinks
    layer_sinks: tuple[bool, ...] = ()
    # whose tensor names the checkpoint uses: Transformers' or "mistral"
    weight_format: str = "safetensors"
    # FP8 or MXFP4 weights (config_quant.py), dequantized while loading
    quant: Quantization | None = None
    # multi-token-prediction layers stored after the decoder's (DeepSeek-V3's
    # num_nextn_predict_layers):
    # layer indices num_layers .. num_layers + mtp_layers - 1, never loaded for plain decoding
    mtp_layers: int = 0
    # a looped model (Nanbeige) runs its loop_layers stored layers num_layers / loop_layers times:
    # layer i
    # holds stored layer i % loop_layers' weights (read once, held once) and its own cache; 0: not
    # looped.
    # loop_pass_norm: the final norm closes every pass, not only the last
    loop_layers: int = 0
    loop_pass_norm: bool = False
    # a looped model of several stacks (HRM-Text), per pass (stack, state, reads): the pass runs
    # stack `stack`'s
    # loop_layers stored layers on the sum of the states `reads` and its output replaces state
    # `state`; state 0
    # starts as the embedding, state 1 as the decoder's loop_init vector. Empty: stack 0 on state 0
    # (Nanbeige)
    loop_schedule: tuple[tuple[int, int, tuple[int, ...]], ...] = ()
    # a prompt read whole from position zero attends both ways within itself (HRM-Text's prefix_lm);
    # decode
    # steps, later tokens and reads without a cache attend causally
    bidirectional_prompt: bool = False
    # the kind of each layer's token mixer and feed-forward (model/kinds.py); empty: attention
    # (latent where
    # mla is set) in every layer, and experts where moe_layers says, else the dense feed-forward
    mixers: tuple[str, ...] = ()
    feed_forwards: tuple[str, ...] = ()
    # the wrapper model_type (config_file.TEXT_WRAPPERS) whose text decoder this is: its weights
    # carry the
    # wrapper's prefixes and its towers are never mapped; None for a plain checkpoint
    wrapper: str | None = None
    raw: dict = field(default_factory=dict, compare=False, repr=False)

    def heads(self, layer: int) -> int:
        """The query heads of `layer`."""
        return self.layer_heads[layer] if self.layer_heads else self.num_heads

    def head_dim_of(self, layer: int) -> int:
        """The width of `layer`'s query and key heads."""
        return self.layer_head_dim[layer] if self.layer_head_dim else self.head_dim

    def kv_heads(self, layer: int) -> int:
        """The key-value heads of `layer`."""
        return self.layer_kv_heads[layer] if self.layer_kv_heads else self.num_kv_heads

    def mla_of(self, layer: int) -> MLAConfig | None:
        """The latent attention sizes of `layer`: its own where the config states them per layer,
        else the model's."""
        own = self.layer_mla[layer] if self.layer_mla else None
        return own or self.mla

    def sinks(self, layer: int) -> bool:
        return self.layer_sinks[layer] if self.layer_sinks else self.attn_sinks

    def gate_sparsity(self, layer: int) -> float:
        """The sparsity p of `layer`'s feed-forward gate (0: dense)."""
        return self.layer_gate_sparsity[layer] if self.layer_gate_sparsity else 0.0

    def mixer(self, layer: int) -> str:
        if self.mixers:
            return self.mixers[layer]
        return "latent_attention" if self.mla is not None else "attention"

    def post_mlp_norm_at(self, layer: int) -> bool:
        return self.post_mlp_norm_layers[layer] if self.post_mlp_norm_layers else self.post_mlp_norm

    def moe_of(self, layer: int) -> MoEConfig | None:
        """The experts of `layer`: its own where the config states them per layer, else the
        model's."""
        own = self.layer_moe[layer] if self.layer_moe else None
        return own or self.moe

    def feed_forward(self, layer: int) -> str:
        if self.feed_forwards:
            return self.feed_forwards[layer]
        return "moe" if self.moe is not None and self.moe_layers[layer] else "dense"

    @property
    def spec(self) -> FamilySpec:
        """The name map of this checkpoint's own tensors."""
        return spec_for(self.family, self.weight_format)

    @property
    def transformers_spec(self) -> FamilySpec:
        """The name map of Transformers' checkpoints of this family: the module names adapters
        use."""
        return spec_for(self.family)

    def with_eos(self, eos: tuple[int, ...]) -> ModelConfig:
        return replace(self, eos_token_ids=eos)

    def summary(self) -> dict:
        return {
            "family": self.family,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "num_layers": self.num_layers,
            "num_heads": self.num_heads,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size,
            "max_position": self.max_position,
            "hidden_act": self.hidden_act,
            "norm": self.norm_kind,
            "norm_eps": self.norm_eps,
            "tie_word_embeddings": self.tie_word_embeddings,
            "rope": sorted({r.rope_type for r in self.layer_rope if r is not None}),
            "sliding_window_layers": sum(w is not None for w in self.layer_window),
            **(
                {"chunked_attention_layers": sum(c is not None for c in self.layer_chunk)}
                if any(self.layer_chunk)
                else {}
            ),
            **(
                {
                    "experts": self.moe.num_experts,
                    "experts_per_token": self.moe.top_k,
                    "moe_layers": sum(self.moe_layers),
                }
                if self.moe
                else {}
            ),
            **(
                {
                    "latent_attention": {
                        "kv_lora_rank": self.mla.kv_lora_rank,
                        "q_lora_rank": self.mla.q_lora_rank,
                    }
                }
                if self.mla
                else {}
            ),
            **({"mtp_layers": self.mtp_layers} if self.mtp_layers else {}),
            **({"loop_layers": self.loop_layers} if self.loop_layers else {}),
            **({"quantization": self.quant.summary()} if self.quant else {}),
        }


def _mla(keys: Keys) -> MLAConfig:
    q_rank = keys.get("q_lora_rank")
    return MLAConfig(
        q_lora_rank=int(q_rank) if q_rank else None,
        kv_lora_rank=int(keys.need("kv_lora_rank")),
        qk_nope_head_dim=int(keys.need("qk_nope_head_dim")),
        qk_rope_head_dim=int(keys.need("qk_rope_head_dim")),
        v_head_dim=int(keys.need("v_head_dim")),
    )


def _layer_mla(raw: dict, mla: MLAConfig | None, path: str) -> tuple[MLAConfig | None, ...]:
    """layer_latent (a family's normalisation writes it): per layer, None or the latent keys that
    layer states over the model's."""
    own = raw.get("layer_latent") or ()
    return tuple(
        _mla(Keys({**raw, **keys}, f"{path} layer {i}")) if keys and mla is not None else None
        for i, keys in enumerate(own)
    )


def _eos(keys: Keys) -> tuple[int, ...]:
    eos = keys.get("eos_token_id")
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list) else (int(eos),)


def from_hf(
    raw: dict, path: str = "config.json", weight_format: str = "safetensors"
) -> ModelConfig:
    """Normalise a Transformers config.json dict (after the architecture gate) into a ModelConfig.

    weight_format chooses the family's name map, and with it the conventions of that format's
    tensors (Mistral's own format stores query and key rows for rotation by adjacent pairs)."""
    family = family_of(raw)
    wrapper = wrapper_of(raw)
    spec = spec_for(family, weight_format)
    if spec is None:
        raise not_runnable(raw, family)
    raw = text_config(raw)
    # a family's default count (EXAONE's 8) is not the config's statement
    kv_stated = _states_kv_heads(raw)
    written, raw = raw, _normalized(raw, spec, path)
    # types and ranges first, of the normalised config with any value the normalisation replaced put
    # back as
    # written (the config's own statement, under its own name): nothing below may divide by, index
    # with or
    # loop over a bad value
    # (latent attention derives its own head width: Transformers writes head_dim there as the
    # rotated width, 0
    # where nothing rotates, GLM-5-Next)
    check_stated(
        {
            **raw,
            **{
                key: value
                for key, value in written.items()
                if raw.get(key) is not value and not (key == "head_dim" and spec.attention.latent)
            },
        },
        path,
    )
    keys = Keys(raw, path)
    for key, why in spec.refuse_keys.items():
        if keys.get(key):
            raise Refusal(f"invalid model config {path}: {key} is set; {why}")
    for key, (value, why) in spec.require_values.items():
        if keys.get(key) is not None and keys.get(key) != value:
            raise Refusal(f"invalid model config {path}: {key} is {keys.get(key)!r}; {why}")
    # MiniMax's layer kinds: 1 is softmax attention, 0 lightning (linear) attention, which no spec
    # runs
    kinds = keys.get("attn_type_list")
    if isinstance(kinds, list) and 0 in kinds:
        lightning = [i for i, kind in enumerate(kinds) if kind == 0]
        raise Refusal(
            f"invalid model config {path}: attn_type_list marks layers {lightning} as lightning "
            "(linear) attention, which ster_dist does not run; only softmax-attention layers (1) "
            "are supported"
        )

    attention, norms, positions = spec.attention, spec.norms, spec.positions
    hidden = int(keys.need("hidden_size", "n_embd", "n_embed", "d_model"))
    num_layers = int(keys.need("num_hidden_layers", "n_layer", "num_layers", "n_layers"))
    mixers, feed_forwards = _layer_kinds(keys, spec, num_layers, path)
    attends = not mixers or any(kind in ATTENDING_MIXERS for kind in mixers)
    if not attends:  # no attention layer (Mamba): no head sizes to read
        keys.raw.setdefault("num_attention_heads", 0)
    num_heads = int(keys.need("num_attention_heads", "n_head", "n_heads"))
    num_kv = 1 if keys.get("multi_query") else int(keys.get(*KV_HEAD_KEYS, default=num_heads))
    head_dim = int(keys.get("head_dim", default=hidden // num_heads if num_heads else 0))
    inner = keys.get("intermediate_size", "n_inner", "ffn_dim", "ffn_hidden_size")
    if isinstance(inner, list):  # a width per layer (Gemma 3n): one for all is what runs
        if len(set(inner)) != 1:
            raise Refusal(
                f"invalid model config {path}: intermediate_size gives layers different widths "
                f"{sorted(set(inner))}; only one feed-forward width for every layer is supported"
            )
        inner = inner[0]
    if inner is None and keys.get("expansion_ratio") is not None:  # MPT
        inner = int(keys.get("expansion_ratio") * hidden)
    intermediate = int(inner if inner is not None else 4 * hidden)
    width = keys.get("word_embed_proj_dim")
    if width is not None and int(width) != hidden:
        raise Refusal(
            f"invalid model config {path}: word_embed_proj_dim {width} differs from the model width "
            f"{hidden}; projecting the embedding in and out is not supported"
        )
    max_position = int(
        keys.get(
            "max_position_embeddings", "n_positions", "seq_length", "max_seq_len", default=4096
        )
    )
    vocab = int(keys.need("vocab_size"))
    eps = float(
        keys.get(
            "rms_norm_eps",
            "layer_norm_eps",
            "norm_epsilon",
            "norm_eps",
            "layer_norm_epsilon",
            default=1e-6,
        )
    )
    if norms.eps is not None:
        eps = norms.eps
    if attends:
        check_sizes(
            path,
            hidden=hidden,
            heads=num_heads,
            kv_heads=num_kv,
            head_dim=head_dim,
            head_dim_stated=keys.get("head_dim") is not None or attention.latent,
            layers=num_layers,
            # latent attention gives every head its own key: its stated key/value count
            # means nothing
            kv_stated=kv_stated and not attention.latent,
            no_rope_layers=keys.get("no_rope_layers"),
        )
    act = keys.get(
        "hidden_act",
        "hidden_activation",
        "activation_function",
        default=(keys.get("ffn_act_fn") or {}).get("name", "silu"),
    )
    act = spec.feed_forward.activation or act
    if act not in ACTIVATIONS:
        raise Refusal(
            f"invalid model config {path}: hidden_act {act!r} is not supported; "
            f"supported: {', '.join(ACTIVATIONS)}"
        )

    mla = _mla(keys) if attention.latent else None
    # latent attention: every head has its own key; only qk_rope_head_dim rotates
    if mla is not None:
        num_kv, head_dim = num_heads, mla.qk_nope_head_dim + mla.qk_rope_head_dim
    # a family of experts whose layer pattern routes no layer (Granite 4.0 without experts) is a
    # dense model
    routes = spec.moe is not None and (
        not feed_forwards or bool(set(ROUTED_FEED_FORWARDS) & set(feed_forwards))
    )
    moe, moe_layers = moe_config(keys, spec, intermediate, num_layers) if routes else (None, ())
    # the family's layer pattern says which layers route (Jamba)
    if moe is not None and feed_forwards:
        moe_layers = tuple(kind in ROUTED_FEED_FORWARDS for kind in feed_forwards)
    # layer_moe_keys (a family's normalisation writes it): per layer, None or the config keys that
    # layer's
    # experts state over the model's (Nemotron Puzzle's block_configs)
    overrides = raw.get("layer_moe_keys") or ()
    layer_moe = tuple(
        moe_config(Keys({**raw, **own}, f"{path} layer {i}"), spec, intermediate, num_layers)[0]
        if own and moe is not None and moe_layers[i]
        else None
        for i, own in enumerate(overrides)
    )
    # value_expert_keys (a family's normalisation writes it): the config keys K2-Horizon's value
    # experts state
    # over the model's experts' (their count and how many each token takes)
    value_keys = raw.get("value_expert_keys")
    value_experts = (
        moe_config(
            Keys({**raw, **value_keys}, f"{path} value experts"), spec, intermediate, num_layers
        )[0]
        if value_keys and moe is not None
        else None
    )
    # where intermediate_size is the experts' width, the dense layers may state their own
    intermediate = int(keys.get("dense_intermediate_size", default=intermediate))
    norm_kind = keys.get("norm_kind", default=norms.kind)
    if norm_kind not in ("rms", "layer"):
        raise Refusal(
            f"invalid model config {path}: norm_kind {norm_kind!r} is not supported; supported: rms, layer"
        )

    alibi = positions.kind == "alibi" or bool(keys.get("alibi"))
    layer_head_dim = per_layer.counts(keys, "layer_head_dim", num_layers)
    layer_rope, layer_window, layer_chunk, full_rope = rotations(
        keys,
        spec,
        num_layers,
        tuple(kind in ATTENDING_MIXERS for kind in mixers),
        moe_layers,
        head_dim,
        mla.qk_rope_head_dim if mla is not None else None,
        max_position,
        alibi,
        layer_head_dim,
    )

    # attention scale and multipliers
    attn_scale = head_dim**-0.5 if head_dim else 1.0  # no attention layer (Mamba): no head width
    if keys.get("query_pre_attn_scalar") is not None:
        attn_scale = float(keys.get("query_pre_attn_scalar")) ** -0.5
    if keys.get("attention_multiplier") is not None:
        attn_scale = float(keys.get("attention_multiplier"))
    if positions.kind == "learned" and keys.get("scale_attn_weights") is False:
        attn_scale = 1.0
    if mla is not None:
        attn_scale = head_dim**-0.5 * yarn_mscale(
            next((r for r in layer_rope if r is not None), None)
        )
    embed_scale = (
        math.sqrt(hidden)
        if spec.embedding.scale_sqrt
        else float(keys.get("embedding_multiplier", "scale_emb", default=1.0))
    )
    logit_multiplier = float(keys.get("logit_scale", default=1.0))
    if keys.get("logits_scaling") is not None:
        logit_multiplier = 1.0 / float(keys.get("logits_scaling"))
    # MiniCPM's muP: the hidden state shrunk before the head
    if keys.get("dim_model_base") is not None:
        logit_multiplier = float(keys.get("dim_model_base")) / hidden
    residual_multiplier = float(keys.get("residual_multiplier", default=1.0))
    if keys.get("scale_depth") is not None:
        residual_multiplier = float(keys.get("scale_depth")) / math.sqrt(num_layers)

    # the generic switches the family's normalisation filled (families/normalize.py)
    qkv_bias = bool(keys.get("attention_bias", default=False))
    o_bias = bool(keys.get("attention_out_bias", default=qkv_bias))
    mlp_bias = bool(keys.get("mlp_bias", default=False))
    qk = attention.qk_norm or QKNormSpec()
    qk_norm = (
        qk.scope
        if attention.qk_norm is not None and keys.get("use_qk_norm", default=True)
        else "none"
    )
    post_norm = bool(keys.get("use_post_norm", default=norms.post))
    parallel = bool(keys.get("use_parallel_residual", default=norms.parallel))
    parallel_norms = keys.get("num_ln_in_parallel_attn")
    shared_norm = norms.parallel_shared if parallel_norms is None else parallel_norms == 1
    pad = keys.get("pad_token_id")
    temperature_beta, temperature_length = 0.0, None
    # stated by the family's normalisation (Llama 4)
    if keys.get("query_temperature_beta") is not None:
        temperature_beta = float(keys.get("query_temperature_beta"))
        temperature_length = keys.need("query_temperature_length")
    elif attention.query_temperature and full_rope.get("llama_4_scaling_beta") is not None:
        temperature_beta = float(full_rope["llama_4_scaling_beta"])
        temperature_length = full_rope.get("original_max_position_embeddings")
        if not temperature_length:
            raise Refusal(
                f"invalid model config {path}: llama_4_scaling_beta is stated without the "
                "original_max_position_embeddings its query temperature counts positions in"
            )

    layer_heads, layer_kv_heads = (
        per_layer.counts(keys, "layer_heads", num_layers),
        per_layer.counts(keys, "layer_kv_heads", num_layers),
    )
    for i in range(num_layers if layer_heads or layer_kv_heads else 0):
        heads, kv = (
            (layer_heads or [num_heads] * num_layers)[i],
            (layer_kv_heads or [num_kv] * num_layers)[i],
        )
        if heads % kv:
            raise Refusal(
                f"invalid model config {path}: layer {i}'s {heads} attention heads do not group over its "
                f"{kv} key-value heads; each key/value head must serve whole query heads; {FIX}"
            )

    return ModelConfig(
        family=family,
        vocab_size=vocab,
        hidden_size=hidden,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv,
        head_dim=head_dim,
        intermediate_size=intermediate,
        max_position=max_position,
        norm_kind=norm_kind,
        norm_groups=_norm_groups(keys, hidden),
        norm_bias=norms.bias,
        norm_eps=eps,
        norm_offset=norms.offset,
        post_norm_offsets=norms.post_offsets,
        norm_affine=norms.affine,
        norm_scale_f32=norms.scale_f32,
        pre_attn_norm=norms.pre,
        pre_mlp_norm=norms.pre and not (parallel and shared_norm),
        post_attn_norm=post_norm,
        post_mlp_norm=post_norm,
        post_mlp_norm_layers=moe_layers
        if keys.get("post_mlp_norm_sparse_only", default=False)
        else (),
        parallel_block=parallel,
        parallel_shared_norm=shared_norm,
        qkv_bias=qkv_bias,
        o_bias=o_bias,
        qk_norm=qk_norm,
        qk_norm_kind=qk.kind,
        qk_norm_per_head_weight=qk.per_head_weight,
        qk_norm_bias=qk.bias,
        attn_scale=attn_scale,
        qk_norm_after_rope=qk.after_rope,
        query_temperature_beta=temperature_beta,
        query_temperature_length=int(temperature_length) if temperature_length else None,
        query_temperature_offset=int(keys.get("query_temperature_offset", default=0)),
        layer_query_temperature=per_layer.switches(keys, "query_temperature_layers", num_layers),
        qk_norm_affine=qk.affine,
        layer_qk_norm=per_layer.switches(keys, "qk_norm_layers", num_layers),
        attn_output_gate=bool(keys.get("attn_output_gate", default=False)),
        softplus_gate=_softplus_gate(keys),
        sigmoid_head_gate=bool(keys.get("sigmoid_head_gate", default=False)),
        layer_glu_limits=per_layer.limits(keys, "glu_limit_layers", num_layers),
        layer_shared_glu_limits=per_layer.limits(keys, "shared_glu_limit_layers", num_layers),
        output_gate=_output_gate(keys),
        attn_softcap=keys.get("attn_logit_softcapping"),
        clip_qkv=keys.get("clip_qkv"),
        layer_rope=tuple(layer_rope),
        layer_window=tuple(layer_window),
        layer_chunk=tuple(layer_chunk),
        learned_positions=positions.kind == "learned" and not alibi,
        position_offset=positions.offset,
        alibi=alibi,
        alibi_before_scale=positions.alibi_before_scale,
        alibi_bf16=positions.alibi_bf16,
        alibi_sqrt=alibi and positions.alibi_sqrt,
        embed_norm=norms.embed,
        embed_norm_affine=norms.embed_affine,
        final_norm_offset=norms.final_offset,
        post_norm_eps=keys.get("post_norm_eps"),
        mlp_gated=spec.feed_forward.gated,
        hidden_act=act,
        mlp_up_bias=mlp_bias,
        mlp_down_bias=bool(keys.get("mlp_down_bias", default=mlp_bias)),
        mlp_multipliers=_mlp_multipliers(keys, path),
        embed_scale=embed_scale,
        residual_multiplier=residual_multiplier,
        residual_fp32=bool(keys.get("residual_in_fp32", default=False)),
        hyper_streams=_hyper_streams(keys),
        recurrent_pre_norm=bool(keys.get("recurrent_pre_norm", default=False)),
        residual_factors=per_layer.residual_factors(keys, num_layers),
        residual_from_norm=bool(keys.get("residual_from_norm", default=False)),
        block_skips=per_layer.block_skips(keys, num_layers),
        logit_multiplier=logit_multiplier,
        scored_vocab=_scored_vocab(keys, vocab),
        sublayer_conv=_sublayer_conv(keys),
        mlp_output_scale=bool(keys.get("mlp_output_scale", default=False)),
        logit_softcap=keys.get("final_logit_softcapping"),
        tie_word_embeddings=bool(keys.get("tie_word_embeddings", default=spec.embedding.tied)),
        lm_head_bias=bool(keys.get("lm_head_bias", default=False)),
        bos_token_id=keys.get("bos_token_id"),
        eos_token_ids=_eos(keys),
        pad_token_id=pad if isinstance(pad, int) else None,
        torch_dtype=keys.get("torch_dtype", "dtype"),
        moe=moe,
        moe_layers=moe_layers,
        layer_moe=layer_moe,
        mla=mla,
        layer_mla=_layer_mla(raw, mla, path),
        attn_sinks=attention.sinks,
        layer_sinks=per_layer.switches(keys, "sink_layers", num_layers),
        layer_heads=layer_heads,
        layer_kv_heads=layer_kv_heads,
        value_experts=value_experts,
        layer_intermediate=per_layer.counts(keys, "layer_intermediate_size", num_layers),
        value_head_dim=keys.get("value_head_dim"),
        query_bottleneck=keys.get("query_bottleneck"),
        value_scale=float(keys.get("attention_value_scale", default=1.0)),
        value_norm=bool(keys.get("value_norm", default=False)),
        swiglu_oai=tuple(float(x) for x in keys.get("swiglu_oai", default=())),
        layer_kv_source=per_layer.kv_sources(keys, num_layers),
        layer_gate_sparsity=per_layer.gate_sparsity(keys, num_layers),
        altup=altup_config(keys),
        laurel_rank=int(keys.get("laurel_rank", default=0)),
        ngram=ngram_config(keys, hidden),
        layer_head_dim=layer_head_dim,
        layer_value_from_key=per_layer.switches(keys, "value_from_key_layers", num_layers),
        layer_scalar=bool(keys.get("layer_scalar", default=False)),
        per_layer_input=int(keys.get("per_layer_input_size", default=0) or 0),
        per_layer_vocab=int(keys.get("per_layer_input_vocab", default=0) or 0),
        weight_format=weight_format,
        wrapper=wrapper,
        raw=raw,
        quant=quantization(raw.get("quantization_config"), path),
        mtp_layers=_mtp_layers(keys, path),
        mixers=mixers,
        feed_forwards=feed_forwards,
        loop_layers=per_layer.loop_layers(keys, num_layers, path),
        loop_pass_norm=bool(keys.get("loop_pass_norm", default=False)),
        loop_schedule=per_layer.loop_schedule(keys, num_layers, path),
        bidirectional_prompt=bool(keys.get("bidirectional_prompt", default=False)),
    )


def _hyper_streams(keys: Keys) -> int:
    n = keys.get("hyper_streams", default=0)
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise Refusal(
            f"invalid model config {keys.path}: the hyper-connections' stream count is {n!r}; state "
            "hc_mult as a positive integer"
        )
    return n


def _scored_vocab(keys: Keys, vocab: int) -> int | None:
    scored = keys.get("scored_vocab_size")
    if scored is None or scored >= vocab:
        return None
    if isinstance(scored, bool) or not isinstance(scored, int) or scored < 1:
        raise Refusal(
            f"invalid model config {keys.path}: scored_vocab_size is {scored!r}; state a positive "
            f"integer no larger than vocab_size {vocab}"
        )
    return scored


def _sublayer_conv(keys: Keys) -> int:
    kernel = keys.get("sublayer_conv_kernel")
    if kernel is None:
        return 0
    if isinstance(kernel, bool) or not isinstance(kernel, int) or kernel < 1:
        raise Refusal(
            f"invalid model config {keys.path}: the short convolutions' kernel is {kernel!r}; state "
            "it as a positive integer"
        )
    return kernel


def _normalized(raw: dict, spec: FamilySpec, path: str) -> dict:
    """The config in the generic keys, through the family's normalisation
    (families/normalize.py)."""
    if spec.normalize is None:
        return raw
    try:
        return spec.normalize(raw)
    except ConfigProblem as problem:
        raise Refusal(f"invalid model config {path}: {problem}") from None


def _states_kv_heads(raw: dict) -> bool:
    """Whether the config itself states a key/value head count, at the top level or in an object it
    nests attention settings in (MPT and DBRX's attn_config)."""
    keys = KV_HEAD_KEYS + ("multi_query",)
    objects = [raw] + [value for value in raw.values() if isinstance(value, dict)]
    return any(obj.get(key) is not None for obj in objects for key in keys)


def _layer_kinds(
    keys: Keys, spec: FamilySpec, num_layers: int, path: str
) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Each layer's mixer and feed-forward kind as the family states them; empty where it states
    none."""
    if spec.layer_kinds is None:
        return (), ()
    mixers, feed_forwards = spec.layer_kinds(keys.raw, num_layers)
    for kinds, known, what in (
        (mixers, MIXER_KINDS, "token mixer"),
        (feed_forwards, FEED_FORWARD_KINDS, "feed-forward"),
    ):
        if len(kinds) != num_layers:
            raise Refusal(
                f"invalid model config {path}: the layer pattern gives {len(kinds)} {what} kinds for "
                f"{num_layers} layers"
            )
        unknown = sorted(set(kinds) - set(known))
        if unknown:
            raise Refusal(
                f"invalid model config {path}: {what} kind {unknown[0]!r} is not supported for {spec.name}"
            )
    return tuple(mixers), tuple(feed_forwards)


def _softplus_gate(keys: Keys) -> str:
    gate = keys.get("softplus_output_gate", default="none")
    if gate not in ("none", "head", "element"):
        raise Refusal(
            f"invalid model config {keys.path}: softplus_output_gate {gate!r} is not one of none, head, "
            "element"
        )
    return gate


def _output_gate(keys: Keys) -> str:
    gate = keys.get("output_gate_func", default="none")
    if gate not in ("none", "silu", "softplus_ln2"):
        raise Refusal(
            f"invalid model config {keys.path}: output_gate_func {gate!r} is not one of none, silu, "
            "softplus_ln2"
        )
    return gate


def _norm_groups(keys: Keys, hidden: int) -> int:
    groups = keys.get("norm_groups", default=1)
    if isinstance(groups, bool) or not isinstance(groups, int) or groups < 1 or hidden % groups:
        raise Refusal(
            f"invalid model config {keys.path}: norm_groups {groups!r} does not split hidden_size "
            f"{hidden} into equal groups; state a divisor of it"
        )
    return groups


def _mlp_multipliers(keys: Keys, path: str) -> tuple[float, float]:
    stated = keys.get("mlp_multipliers", default=[1.0, 1.0])
    if (
        not isinstance(stated, (list, tuple))
        or len(stated) != 2
        or not all(isinstance(m, (int, float)) and not isinstance(m, bool) for m in stated)
    ):
        raise Refusal(
            f"invalid model config {path}: mlp_multipliers is {stated!r}; it must be two numbers (the "
            "gate's and the feed-forward output's scale); correct it or leave it out"
        )
    return float(stated[0]), float(stated[1])


def _mtp_layers(keys: Keys, path: str) -> int:
    n = keys.get("num_nextn_predict_layers", default=0)
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise Refusal(
            f"invalid model config {path}: num_nextn_predict_layers is {n!r}, not a count of layers"
        )
    return n
