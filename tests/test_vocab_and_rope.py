"""Single-process numerics: vocab-parallel logprobs at TP1 and RoPE frequencies vs HF."""

from __future__ import annotations

import pytest
import torch

from megarlhf.models.config import ModelConfig, RopeScaling
from megarlhf.parallel.vocab import vocab_parallel_logprobs


def test_logprobs_and_grad_equal_log_softmax_with_padding_excluded():
    torch.manual_seed(0)
    vocab, padded = 50, 64
    logits = torch.randn(3, 7, padded, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, vocab, (3, 7))
    got = vocab_parallel_logprobs(logits, labels, tp_group=None, vocab_start=0, vocab_size=vocab)
    want = torch.log_softmax(logits[..., :vocab], -1).gather(-1, labels[..., None])[..., 0]
    torch.testing.assert_close(got.double(), want, atol=1e-6, rtol=0)  # fp32 compute
    weights = torch.randn(3, 7, dtype=torch.float64)
    (g_got,) = torch.autograd.grad((got * weights).sum(), logits)
    (g_want,) = torch.autograd.grad((want * weights).sum(), logits)
    torch.testing.assert_close(g_got, g_want, atol=1e-6, rtol=0)
    assert g_got[..., vocab:].abs().max() == 0  # padding rows get no gradient


def test_logprobs_reject_out_of_vocab_labels():
    with pytest.raises(ValueError, match="outside the vocabulary"):
        vocab_parallel_logprobs(torch.zeros(1, 2, 8), torch.tensor([[1, 9]]), tp_group=None,
                                vocab_start=0, vocab_size=8)


@pytest.mark.parametrize("scaling", [
    None,
    RopeScaling(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                original_max_position_embeddings=8192),
    RopeScaling(rope_type="llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                original_max_position_embeddings=8192),
    RopeScaling(rope_type="llama3", factor=4.0, low_freq_factor=2.0, high_freq_factor=8.0,
                original_max_position_embeddings=64),
    RopeScaling(rope_type="linear", factor=2.0),
])
def test_rope_inv_freq_matches_transformers(scaling):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    ours = ModelConfig(vocab_size=10, hidden_size=256, ffn_hidden_size=512, num_layers=1,
                       num_attention_heads=2, rope_theta=500000.0, rope_scaling=scaling,
                       max_position_embeddings=131072)
    rope = {"rope_type": "default", "rope_theta": 500000.0}
    if scaling is not None:
        rope = {"rope_type": scaling.rope_type, "rope_theta": 500000.0, "factor": scaling.factor}
        if scaling.rope_type == "llama3":
            rope.update(low_freq_factor=scaling.low_freq_factor,
                        high_freq_factor=scaling.high_freq_factor,
                        original_max_position_embeddings=scaling.original_max_position_embeddings)
    hf = LlamaConfig(hidden_size=256, num_attention_heads=2, max_position_embeddings=131072,
                     rope_parameters=rope)
    if rope["rope_type"] == "default":
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        want = LlamaRotaryEmbedding.compute_default_rope_parameters(hf, device="cpu")[0]
    else:
        want = ROPE_INIT_FUNCTIONS[rope["rope_type"]](hf, "cpu")[0]
    # Both compute in fp32 at the end; ours forms the frequencies in fp64 first.
    torch.testing.assert_close(ours.rope_inv_freq(), want.float(), rtol=1e-6, atol=0)
