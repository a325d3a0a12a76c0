"""Packed (THD) rows, models/packed.py: where segments fall, which keys a query sees, and a
real model's logits of packed documents against each document run alone."""

from __future__ import annotations

import pytest
import torch
from megatron.core import tensor_parallel

from megarlhf.data.packing import document_mask
from megarlhf.models.gpt import build_model, model_spec
from megarlhf.models.packed import packed_segments, segments
from megarlhf.models.presets import preset
from megarlhf.parallel.mesh import ParallelConfig
from tests.fake_world import fake_rank


def test_segments_are_runs_of_one_document_within_a_row():
    # A left-padded row, then a packed row with a padding tail (ids as data/ gives them).
    ids = torch.tensor([[-1, -2, -3, 0, 0, 0],
                        [0, 0, 1, 1, 1, -1]])
    seg = segments(ids, torch.device("cpu"))
    assert seg.bounds == (0, 3, 6, 8, 11, 12)
    assert seg.cu_seqlens_q.tolist() == list(seg.bounds) and seg.cu_seqlens_q.dtype == torch.int32
    assert seg.max_seqlen_q == seg.max_seqlen_kv == 3 and seg.qkv_format == "thd"
    # Only rows that pack documents run packed; one document per row keeps the batched mask.
    assert packed_segments(ids, torch.device("cpu")).bounds == seg.bounds
    assert packed_segments(ids[:1], torch.device("cpu")) is None
    assert packed_segments(torch.tensor([[0, 0, -1], [-2, 0, 0]]), torch.device("cpu")) is None


def test_a_real_query_sees_under_segments_what_the_document_mask_shows_it():
    """Real tokens (id >= 0) of rows laid out as data/ lays them out see the same keys in the
    packed layout as under the document mask the CP path and the layout tests use."""
    gen = torch.Generator().manual_seed(0)
    rows = []
    for _ in range(6):
        lengths = torch.randint(1, 6, (int(torch.randint(1, 4, (1,), generator=gen)),),
                                generator=gen)
        ids = torch.repeat_interleave(torch.arange(len(lengths)), lengths)
        left, right = (int(torch.randint(0, 3, (1,), generator=gen)) for _ in range(2))
        rows.append(torch.cat([-torch.arange(1, left + 1), ids,
                               -torch.arange(left + 1, left + right + 1)]))
    T = max(len(r) for r in rows)
    ids = torch.stack([torch.cat([r, -torch.arange(100, 100 + T - len(r))]) for r in rows])
    bounds = segments(ids, torch.device("cpu")).bounds
    flat = torch.arange(ids.numel())
    segment_of = torch.bucketize(flat, torch.tensor(bounds[1:]), right=True)
    sees = (segment_of[:, None] == segment_of[None, :]) & (flat[:, None] >= flat[None, :])
    masked = document_mask(ids)[:, 0]  # [B, T, T]
    real = (ids >= 0).reshape(-1)
    for b in range(ids.shape[0]):
        block = sees[b * T:(b + 1) * T, b * T:(b + 1) * T]
        rows_real = real[b * T:(b + 1) * T]
        assert torch.equal(block[rows_real], ~masked[b][rows_real])
    # and nothing across rows
    row_of = flat // T
    assert not (sees & (row_of[:, None] != row_of[None, :])).any()


@pytest.mark.parametrize("spec", ["local", "sdpa"])
def test_packed_documents_have_their_logits_alone(spec):
    """The tiny model's logits of four documents packed into one row (with a padding tail)
    equal each document's logits run alone, unpacked and unmasked. Tolerance 1e-5: fp32 with
    the same weights, only the summation order of attention differs (measured ~1e-7)."""
    parallel = ParallelConfig()
    model = preset("tiny")
    with fake_rank(parallel, 0) as mesh:
        torch.manual_seed(0)
        tensor_parallel.model_parallel_cuda_manual_seed(0)
        chunk = build_model(model_spec(model, parallel, layer_spec=spec, on_gpu=False),
                            mesh)[0].eval()
        lengths = [5, 1, 9, 3]
        docs = [torch.randint(model.vocab_size, (n,)) for n in lengths]
        ids = torch.cat([torch.full((n,), d) for d, n in enumerate(lengths)]
                        + [torch.tensor([-1, -2])])
        tokens = torch.cat(docs + [torch.zeros(2, dtype=torch.long)])
        positions = torch.cat([torch.arange(n) for n in lengths] + [torch.zeros(2).long()])
        with torch.no_grad():
            packed = chunk(tokens[None], positions[None], None,
                           packed_seq_params=segments(ids[None], mesh.device))[0]
            start = 0
            for doc in docs:
                n = len(doc)
                alone = chunk(doc[None], torch.arange(n)[None], None)[0]
                torch.testing.assert_close(packed[start:start + n], alone, atol=1e-5, rtol=1e-5)
                start += n
