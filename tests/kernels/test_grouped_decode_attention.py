"""One query per row over grouped key heads (model/attention.one_query_grouped), the path a bf16 /
f16 decode step takes instead of SDPA's enable_gqa: the attention a reference computes with every
key head repeated for its query heads, and, in a real bf16 model, decode steps from the cache equal
to the whole read."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ster_dist.load import load_model
from ster_dist.model.attention import one_query_grouped
from ster_dist.resolve import resolve
from ster_dist.load.toy import make_toy_model


def repeated_heads(q, k, v, scale):
    """Attention in f32 with each key and value head repeated for the query heads that share it."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.float().repeat_interleave(groups, dim=1), v.float().repeat_interleave(groups, dim=1)
    probs = torch.softmax(q.float() @ k.transpose(-1, -2) * scale, dim=-1)
    return probs @ v


@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (8, 1), (4, 2)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_grouped_queries_attend_as_repeated_key_heads(heads, kv_heads, dtype):
    gen = torch.Generator().manual_seed(heads * 10 + kv_heads)
    q = torch.randn(2, heads, 1, 64, generator=gen).to(dtype)
    k = torch.randn(2, kv_heads, 37, 64, generator=gen).to(dtype)
    v = torch.randn(2, kv_heads, 37, 48, generator=gen).to(dtype)
    got = one_query_grouped(q, k, v, 0.125)
    assert got.shape == (2, heads, 1, 48) and got.dtype == dtype
    want = repeated_heads(q, k, v, 0.125)
    assert (got.float() - want).abs().max().item() < 2e-2
    sdpa = F.scaled_dot_product_attention(q, k, v, scale=0.125, enable_gqa=True)
    assert torch.allclose(got.float(), sdpa.float(), atol=1e-2)
    # a head's output is its own group's: swapping two key heads moves exactly those groups' outputs
    if kv_heads > 1:
        swapped = one_query_grouped(q, k.flip(1), v.flip(1), 0.125)
        assert not torch.allclose(swapped.float(), got.float(), atol=1e-2)


@torch.inference_mode()
def test_bf16_decode_steps_equal_the_whole_read(tmp_path):
    # 4 query heads over 2 key heads
    make_toy_model(tmp_path / "llama", layers=2, hidden=64, seed=5)
    model = load_model(resolve(str(tmp_path / "llama")), precision="bf16").model
    assert model.dtype == torch.bfloat16
    ids = torch.randint(3, 400, (2, 12), generator=torch.Generator().manual_seed(1))
    whole = model(ids).float()
    cache = model.new_cache(2, ids.shape[1])
    width = 7
    steps = [model(ids[:, :width], cache=cache).float()]
    for t in range(width, ids.shape[1]):  # one token a step: the grouped one-query path
        steps.append(model(ids[:, t : t + 1], cache=cache).float())
    stepped = torch.cat(steps, dim=1)
    rel = ((stepped - whole).norm() / whole.norm()).item()
    cos = F.cosine_similarity(stepped.flatten(), whole.flatten(), dim=0).item()
    assert rel < 2e-2 and cos > 0.999, (rel, cos)
