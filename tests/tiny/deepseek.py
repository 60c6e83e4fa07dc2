"""Tiny checkpoints of ster_dist/families/deepseek.py's families."""

from __future__ import annotations

import json
from pathlib import Path

from safetensors.torch import load_file, save_file

TINY: dict[str, tuple[str, str, dict]] = {
    "deepseek_v2": (
        "DeepseekV2Config",
        "DeepseekV2ForCausalLM",
        dict(
            n_routed_experts=8,
            num_experts_per_tok=2,
            n_shared_experts=1,
            moe_intermediate_size=16,
            kv_lora_rank=16,
            q_lora_rank=None,
            qk_nope_head_dim=8,
            qk_rope_head_dim=4,
            v_head_dim=12,
            first_k_dense_replace=1,
            topk_method="group_limited_greedy",
            n_group=4,
            topk_group=2,
            routed_scaling_factor=1.5,
            rope_parameters={
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 32,
                "mscale": 1.0,
                "mscale_all_dim": 0.8,
                "rope_theta": 10000.0,
            },
        ),
    ),
    "deepseek_v3": (
        "DeepseekV3Config",
        "DeepseekV3ForCausalLM",
        dict(
            n_routed_experts=8,
            num_experts_per_tok=2,
            n_shared_experts=1,
            moe_intermediate_size=16,
            kv_lora_rank=16,
            q_lora_rank=24,
            qk_nope_head_dim=8,
            qk_rope_head_dim=4,
            v_head_dim=12,
            first_k_dense_replace=1,
            n_group=4,
            topk_group=2,
            routed_scaling_factor=2.5,
            rope_parameters={
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 32,
                "mscale": 1.0,
                "mscale_all_dim": 1.0,
                "rope_theta": 10000.0,
            },
        ),
    ),
    # latent attention with YaRN, sigmoid noaux_tc routing, a dense middle layer named by
    # mlp_layer_types
    "glm4_moe_lite": (
        "Glm4MoeLiteConfig",
        "Glm4MoeLiteForCausalLM",
        dict(
            n_routed_experts=8,
            num_experts_per_tok=2,
            n_shared_experts=1,
            moe_intermediate_size=16,
            kv_lora_rank=16,
            q_lora_rank=24,
            qk_nope_head_dim=8,
            qk_rope_head_dim=4,
            v_head_dim=12,
            n_group=4,
            topk_group=2,
            routed_scaling_factor=1.8,
            mlp_layer_types=["sparse", "dense", "sparse"],
            rope_parameters={
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 32,
                "mscale": 1.0,
                "mscale_all_dim": 1.0,
                "rope_theta": 10000.0,
            },
        ),
    ),
    # DeepSeek Sparse Attention: fewer indexer keys (index_topk) than the parity prompts' 40 tokens,
    # so the
    # indexer's choice shapes every later query; eight indexer heads keep exact ties in its scores
    # rare
    "deepseek_v32": (
        "DeepseekV32Config",
        "DeepseekV32ForCausalLM",
        dict(
            n_routed_experts=8,
            num_experts_per_tok=2,
            n_shared_experts=1,
            moe_intermediate_size=16,
            kv_lora_rank=16,
            q_lora_rank=24,
            qk_nope_head_dim=8,
            qk_rope_head_dim=4,
            v_head_dim=12,
            first_k_dense_replace=1,
            n_group=4,
            topk_group=2,
            routed_scaling_factor=2.5,
            index_topk=12,
            index_n_heads=8,
            index_head_dim=16,
            rope_parameters={
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 32,
                "mscale": 1.0,
                "mscale_all_dim": 1.0,
                "rope_theta": 10000.0,
            },
        ),
    ),
    # its middle layer reuses the first layer's choice (indexer_types "shared")
    "glm_moe_dsa": (
        "GlmMoeDsaConfig",
        "GlmMoeDsaForCausalLM",
        dict(
            n_routed_experts=8,
            num_experts_per_tok=2,
            n_shared_experts=1,
            moe_intermediate_size=16,
            kv_lora_rank=16,
            q_lora_rank=24,
            qk_nope_head_dim=8,
            qk_rope_head_dim=4,
            v_head_dim=12,
            first_k_dense_replace=1,
            n_group=1,
            topk_group=1,
            routed_scaling_factor=1.5,
            index_topk=12,
            index_n_heads=8,
            index_head_dim=16,
            indexer_types=["full", "shared", "full"],
        ),
    ),
    "minicpm3": (
        "MiniCPM3Config",
        "MiniCPM3ForCausalLM",
        dict(
            kv_lora_rank=16,
            q_lora_rank=24,
            qk_nope_head_dim=8,
            qk_rope_head_dim=4,
            v_head_dim=12,
            scale_emb=2.0,
            scale_depth=1.4,
            dim_model_base=32,
        ),
    ),
    # Transformers runs Sarvam-105B as DeepSeek-V3: no query compression, YaRN, one expert group,
    # saved in
    # Sarvam's own config spellings (_as_sarvam_release)
    "sarvam_mla": (
        "SarvamMLAConfig",
        "DeepseekV3ForCausalLM",
        dict(
            n_routed_experts=8,
            num_experts_per_tok=2,
            n_shared_experts=2,
            moe_intermediate_size=16,
            kv_lora_rank=16,
            q_lora_rank=None,
            qk_nope_head_dim=8,
            qk_rope_head_dim=4,
            v_head_dim=12,
            routed_scaling_factor=2.0,
            initializer_range=0.02,
            rope_parameters={
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 32,
                "mscale": 1.0,
                "mscale_all_dim": 1.0,
                "rope_theta": 10000.0,
            },
        ),
    ),
    # a compressed query, a post-feed-forward norm on the sparse layers, sigmoid routing in groups
    # with every group
    # kept (where Transformers' and A.X-K1's group ranking agree), saved as A.X-K1's release
    # (_as_axk1_release)
    "axk1": (
        "AXK1Config",
        "AXK1ForCausalLM",
        dict(
            n_routed_experts=8,
            num_experts_per_tok=2,
            n_shared_experts=1,
            moe_intermediate_size=16,
            kv_lora_rank=16,
            q_lora_rank=24,
            qk_nope_head_dim=8,
            qk_rope_head_dim=4,
            v_head_dim=12,
            n_group=4,
            topk_group=4,
            routed_scaling_factor=1.5,
            num_key_value_heads=4,
            mlp_layer_types=["dense", "sparse", "sparse"],
        ),
    ),
}


def _as_axk1_release(directory: Path) -> None:
    """Rewrite the saved checkpoint as A.X-K1 publishes it: topk_method none and no selection bias
    (Transformers saves its zero bias). Its releases also keep a post_mlp_layernorm in the dense
    layers, which nothing applies: tests/load/test_unused_layer_tensors.py adds one."""
    path = directory / "config.json"
    config = json.loads(path.read_text())
    config.update(topk_method="none", scoring_func="sigmoid")
    path.write_text(json.dumps(config, indent=2))
    for file in directory.glob("*.safetensors"):
        tensors = {
            name: t
            for name, t in load_file(file).items()
            if not name.endswith("e_score_correction_bias")
        }
        save_file(tensors, file, metadata={"format": "pt"})


def _as_sarvam_release(directory: Path) -> None:
    """Rewrite the saved config as sarvamai/sarvam-105b states it: a deepseek_yarn rope_scaling
    beside a top-level rope_theta, num_experts / num_shared_experts, score_function, the expert-bias
    switch and the head_dim vLLM's latent attention reads (kv_lora_rank + qk_rope_head_dim)."""
    path = directory / "config.json"
    config = json.loads(path.read_text())
    rope = config.pop("rope_parameters")
    config["rope_theta"] = rope.pop("rope_theta")
    config["rope_scaling"] = {
        **{k: v for k, v in rope.items() if k != "rope_type"},
        "type": "deepseek_yarn",
    }
    config["num_experts"], config["num_shared_experts"] = (
        config.pop("n_routed_experts"),
        config.pop("n_shared_experts"),
    )
    config.pop("qk_head_dim", None)
    config.update(
        head_dim=config["kv_lora_rank"] + config["qk_rope_head_dim"],
        score_function="sigmoid",
        moe_router_enable_expert_bias=True,
        moe_shared_expert_intermediate_size=config["moe_intermediate_size"],
    )
    path.write_text(json.dumps(config, indent=2))


SAVED_AS = {"sarvam_mla": _as_sarvam_release, "axk1": _as_axk1_release}
