"""A tensor a checkpoint stores in layers that never apply it (a rule marked optional): A.X-K1's
releases keep a post_mlp_layernorm in their dense layers, which only the sparse layers apply. The
loader skips it there, and the model is the one read without it; the same tensor where its layer
does apply it is still read."""

from __future__ import annotations

import torch
from safetensors.torch import load_file, save_file

from ster_dist.load import load_model
from ster_dist.resolve import resolve
from tests.tiny_models import make_tiny


def _logits(directory, ids):
    loaded = load_model(resolve(str(directory)), "f32")
    with torch.no_grad():
        return loaded.model(ids)


def test_a_dense_layers_stored_post_mlp_norm_is_skipped(tmp_path):
    reference = make_tiny("axk1", tmp_path)
    ids = torch.randint(3, 300, (2, 9), generator=torch.Generator().manual_seed(0))
    before = _logits(tmp_path, ids)
    with torch.no_grad():
        theirs = reference(ids).logits
    torch.testing.assert_close(before, theirs, rtol=1e-4, atol=1e-4)
    (file,) = tmp_path.glob("*.safetensors")
    tensors = load_file(file)
    # layer 0 is dense in the tiny checkpoint
    assert "model.layers.0.post_mlp_layernorm.weight" not in tensors
    tensors["model.layers.0.post_mlp_layernorm.weight"] = (
        tensors["model.layers.1.post_mlp_layernorm.weight"] * 2
    )
    save_file(tensors, file, metadata={"format": "pt"})
    assert torch.equal(_logits(tmp_path, ids), before)
    # the sparse layer's own norm is read: changing it changes the logits
    tensors["model.layers.1.post_mlp_layernorm.weight"] = (
        tensors["model.layers.1.post_mlp_layernorm.weight"] * 2
    )
    save_file(tensors, file, metadata={"format": "pt"})
    assert not torch.allclose(_logits(tmp_path, ids), before)
