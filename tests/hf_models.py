"""Toy HF checkpoints of every supported architecture, made locally with transformers.

Every weight is randomised (norm weights around 1, biases non-zero), so a converter that
swaps, drops or mis-orders any tensor changes the logits.
"""

from __future__ import annotations

import torch
import transformers

COMMON = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
              rms_norm_eps=1e-6, pad_token_id=0, bos_token_id=1, eos_token_id=2)

ARCHS = {
    # Llama 3.1-style RoPE scaling, untied.
    "llama": ("Llama", dict(rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                          "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                          "original_max_position_embeddings": 64},
                            rope_theta=500000.0)),
    # Linear RoPE scaling; sliding window as long as the context.
    "mistral": ("Mistral", dict(sliding_window=256, rope_theta=1e6,
                                rope_scaling={"rope_type": "linear", "factor": 2.0})),
    # QKV bias and tied embeddings, as on small Qwen2.5 models.
    "qwen2": ("Qwen2", dict(tie_word_embeddings=True)),
    # QK-norm and a head_dim that is not hidden / heads.
    "qwen3": ("Qwen3", dict(head_dim=32)),
    # Mixture of experts: 4 experts, top-2. Qwen3-MoE's top-k weights kept unnormalised
    # (softmax over all experts, Qwen2-MoE style), Mixtral's renormalised, so both router
    # variants are checked against HF.
    "qwen3_moe": ("Qwen3Moe", dict(head_dim=32, num_experts=4, num_experts_per_tok=2,
                                   moe_intermediate_size=48, norm_topk_prob=False)),
    "mixtral": ("Mixtral", dict(num_local_experts=4, num_experts_per_tok=2,
                                intermediate_size=48, rope_theta=1e6)),
}
MOE_ARCHS = ("qwen3_moe", "mixtral")


def make_config(arch: str, *, seq_cls: bool = False, **overrides):
    prefix, extra = ARCHS[arch]
    cls = getattr(transformers, f"{prefix}Config")
    config = cls(**{**COMMON, **extra, **overrides})
    config.architectures = [f"{prefix}For{'SequenceClassification' if seq_cls else 'CausalLM'}"]
    if seq_cls:
        config.num_labels = 1
    return config


def make_model(arch: str, *, seq_cls: bool = False, seed: int = 0,
               dtype: torch.dtype = torch.float32, **overrides):
    config = make_config(arch, seq_cls=seq_cls, **overrides)
    torch.manual_seed(seed)
    cls = transformers.AutoModelForSequenceClassification if seq_cls \
        else transformers.AutoModelForCausalLM
    model = cls.from_config(config, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.05 * torch.randn(p.shape, generator=g))
    return model.to(dtype).eval()


def save_chat_llama(directory: str, seed: int = 0) -> str:
    """The multi-turn tests' toy chat model as an HF directory: a tied Llama of head_dim 32
    (2 layers, hidden 128; vLLM's CPU attention serves it) with the ChatML test tokenizer
    (tests/chat_tokenizer.py; its <|im_end|> is the model's EOS, id 2); `seed` draws its
    weights (another seed: another model of the same tokenizer, e.g. a teacher)."""
    import os

    from tests import chat_tokenizer

    save_model(directory, "llama", hidden_size=128, intermediate_size=256,
               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               tie_word_embeddings=True, max_position_embeddings=1024, seed=seed)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if os.path.exists(os.path.join(directory, name)):
            os.remove(os.path.join(directory, name))
    chat_tokenizer.save(directory)
    return directory


def save_model(directory: str, arch: str, **kwargs) -> str:
    """Save a toy model (and a small tokenizer) as an HF checkpoint directory."""
    model = make_model(arch, **kwargs)
    model.save_pretrained(directory)
    _tokenizer().save_pretrained(directory)
    return directory


def _tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2}
    for i in range(256):
        vocab.setdefault(f"b{i}", len(vocab))
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>",
                                                bos_token="<s>", eos_token="</s>")
