"""Mixture-of-experts config rules the tiny parity checkpoints do not vary: which layers are sparse
(ERNIE's index range, HunYuan's skipped layers, GLM-4.7-Flash's mlp_layer_types), sizes stated once
per layer, shared-expert widths, and the refusals; sections follow ster_dist/families/."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from ster_dist.config import from_hf
from ster_dist.errors import Refusal
from ster_dist.load import load_model
from ster_dist.resolve import resolve
from tests.tiny_models import make_tiny

_BASE = dict(
    hidden_size=48, intermediate_size=80, num_hidden_layers=4, num_attention_heads=4, vocab_size=300
)


def _cfg(model_type: str, **kw):
    return from_hf({"model_type": model_type, **_BASE, **kw})


# --------------------------------------------------------------------------------------------------
# ernie.py
# --------------------------------------------------------------------------------------------------


def test_ernie_sparse_layers_are_the_index_range_every_interval():
    moe = dict(moe_num_experts=8, moe_k=2, moe_intermediate_size=16, moe_num_shared_experts=2)
    assert _cfg(
        "ernie4_5_moe", **moe, moe_layer_start_index=1, moe_layer_end_index=-1
    ).moe_layers == (False, True, True, True)
    assert _cfg(
        "ernie4_5_moe", **moe, moe_layer_start_index=0, moe_layer_end_index=2, moe_layer_interval=2
    ).moe_layers == (False, True, False, False)
    cfg = _cfg("ernie4_5_moe", **moe, use_bias=True)
    assert (
        cfg.moe.shared_intermediate_size == 32 and cfg.moe.correction_bias and cfg.moe.renormalize
    )
    assert cfg.lm_head_bias and cfg.tie_word_embeddings and cfg.layer_rope[0].interleaved


def test_an_ernie_selection_bias_not_of_the_expert_count_is_refused(tmp_path):
    make_tiny("ernie4_5_moe", tmp_path)
    path = tmp_path / "model.safetensors"
    tensors = load_file(str(path))
    name = "model.layers.1.mlp.moe_statics.e_score_correction_bias"
    assert tensors[name].shape == (1, 8)
    assert load_model(resolve(str(tmp_path))).model is not None  # [1, experts] reads into [experts]
    tensors[name] = torch.zeros(1, 9)
    save_file(tensors, str(path))
    with pytest.raises(Refusal, match=r"e_score_correction_bias has shape \[1, 9\]"):
        load_model(resolve(str(tmp_path)))


# --------------------------------------------------------------------------------------------------
# hunyuan.py
# --------------------------------------------------------------------------------------------------


def test_hunyuan_sizes_per_layer_shared_width_and_skipped_layers():
    cfg = _cfg(
        "hunyuan_v1_moe",
        num_experts=[6] * 4,
        moe_topk=[2] * 4,
        moe_layer_num_skipped=1,
        num_shared_expert=[2] * 4,
    )
    assert (cfg.moe.num_experts, cfg.moe.top_k) == (6, 2) and cfg.moe_layers == (
        False,
        True,
        True,
        True,
    )
    assert cfg.moe.shared_intermediate_size == 160 and cfg.qk_norm_after_rope
    assert (
        _cfg(
            "hunyuan_v1_moe", num_experts=6, moe_topk=2, use_mixed_mlp_moe=False
        ).moe.shared_intermediate_size
        == 0
    )
    with pytest.raises(Refusal, match=r"moe_topk differs between layers"):
        _cfg("hunyuan_v1_moe", num_experts=6, moe_topk=[2, 2, 1, 2])
    for key in ("use_cla", "use_mla"):
        with pytest.raises(Refusal, match=f"{key} is set"):
            _cfg("hunyuan_v1_moe", num_experts=6, moe_topk=2, **{key: True})


# --------------------------------------------------------------------------------------------------
# deepseek.py: GLM-4.7-Flash
# --------------------------------------------------------------------------------------------------


def test_glm4_moe_lite_sparse_layers_from_mlp_layer_types_or_the_first_dense():
    mla = dict(
        n_routed_experts=8,
        num_experts_per_tok=2,
        kv_lora_rank=16,
        qk_nope_head_dim=8,
        qk_rope_head_dim=4,
        v_head_dim=12,
    )
    assert _cfg("glm4_moe_lite", **mla).moe_layers == (False, True, True, True)
    assert _cfg(
        "glm4_moe_lite", **mla, mlp_layer_types=["sparse", "dense", "sparse", "dense"]
    ).moe_layers == (True, False, True, False)
    cfg = _cfg("glm4_moe_lite", **mla)
    assert (
        cfg.moe.topk_method == "noaux_tc" and cfg.moe.scoring == "sigmoid" and cfg.mla is not None
    )
    with pytest.raises(Refusal, match="mlp_layer_types"):
        _cfg("glm4_moe_lite", **mla, mlp_layer_types=["dense", "sparse"])


# --------------------------------------------------------------------------------------------------
# granite.py and olmo.py: GraniteMoE shared, FlexOlmo
# --------------------------------------------------------------------------------------------------


def test_granitemoeshared_width_and_flex_olmo_post_norms():
    cfg = _cfg(
        "granitemoeshared", num_local_experts=6, num_experts_per_tok=2, shared_intermediate_size=40
    )
    assert cfg.moe.shared_intermediate_size == 40 and cfg.moe.renormalize
    cfg = _cfg("flex_olmo", num_experts=7, num_experts_per_tok=2)
    assert (
        cfg.post_attn_norm
        and not cfg.pre_attn_norm
        and cfg.qk_norm == "proj"
        and not cfg.moe.renormalize
    )


# --------------------------------------------------------------------------------------------------
# mixtral.py: MiniMax-M2
# --------------------------------------------------------------------------------------------------


def test_minimax_lightning_attention_layers_are_refused_by_their_indexes():
    moe = dict(num_local_experts=8, num_experts_per_tok=2)
    assert _cfg("minimax_m2", **moe, attn_type_list=[1, 1, 1, 1]).moe.num_experts == 8
    with pytest.raises(
        Refusal, match=r"attn_type_list marks layers \[0, 2\] as lightning \(linear\) attention"
    ):
        _cfg("minimax_m2", **moe, attn_type_list=[0, 1, 0, 1])
