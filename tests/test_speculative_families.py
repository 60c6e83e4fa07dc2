"""MTP drafts beyond DeepSeek-V3 (model/mtp.py's layouts): GLM-4.5 (glm4_moe), whose MTP layer is stored as
DeepSeek-V3's (model.layers.{num_hidden_layers}: enorm, hnorm, eh_proj, shared_head and a sparse decoder layer),
drafts in the token engine: greedy output with drafts equals greedy output without, and an MTP layer made to
echo its input token gets drafts accepted (tests/test_speculative.py's checkpoint writer)."""

from __future__ import annotations

import json

import pytest

from ster_dist.config_load import model_config
from ster_dist.model.mtp import mtp_config
from ster_dist.resolve import resolve
from tests.test_speculative import counted, run, with_mtp


@pytest.fixture(scope="module")
def glm_echo(tmp_path_factory):
    return with_mtp(tmp_path_factory.mktemp("glm4_moe_echo"), echo=True, family="glm4_moe")


def test_glm4_moes_mtp_layer_is_a_sparse_layer(glm_echo):
    """first_k_dense_replace counts the MTP layer among the sparse ones, as Transformers' Glm4MoeConfig would."""
    cfg = model_config(resolve(str(glm_echo)))
    raw = json.loads((glm_echo / "config.json").read_text())
    assert raw["first_k_dense_replace"] < cfg.num_layers
    ext = mtp_config(cfg, raw)
    assert ext.num_layers == cfg.num_layers + 1
    assert ext.feed_forward(cfg.num_layers) == cfg.feed_forward(cfg.num_layers - 1) == "moe"


def test_glm4_moes_echoing_mtp_layer_drafts_and_keeps_greedy_output(glm_echo):
    plain, _ = run(glm_echo, 0)
    got, stats = run(glm_echo, 2)
    assert got == plain
    counted(stats)
    assert stats["accepted_tokens"] > 0
