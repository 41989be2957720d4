# Token data and tiny Llamas for the tensor, context and pipeline parallel tests.
"""Shared by tests/unit/test_parallel_plans.py with tests/distributed/test_tensor_parallel.py
(:class:`Tokens`, :func:`llama`: 2 layers, not ``conftest.llama``) and with
tests/distributed/test_mesh_layout.py (:func:`heads8`)."""

import torch
from torch.utils.data import Dataset


class Tokens(Dataset):
    """Token ids with a third of the labels masked (token counts differ between batches)."""

    def __init__(self, size=64, seq=8, vocab=64):
        gen = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, vocab, (size, seq), generator=gen)
        self.labels = self.ids.clone()
        self.labels[torch.rand(self.ids.shape, generator=gen) < 0.33] = -100

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.labels[i]}


def llama(tie=False, heads=4, kv_heads=2):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=heads, num_key_value_heads=kv_heads,
                         max_position_embeddings=32, tie_word_embeddings=tie)
    return LlamaForCausalLM(config)


def heads8():
    """A tiny Llama with 8 attention heads (cp=4 x tp=2 gives each rank one)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=32,
        attn_implementation="sdpa"))
