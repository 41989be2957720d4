# A tiny Llama, its token data and a ZeRO-2 config for the Trainer tests.
"""Shared by tests/unit/test_trainer_seam.py, tests/distributed/test_trainer.py and
tests/distributed/test_trl.py."""

import torch

VOCAB, LENGTH = 64, 8


def tiny_llama(dropout=0.0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=LENGTH,
        attention_dropout=dropout))


def token_data(count, seed):
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (count, LENGTH), generator=generator)
    labels = ids.clone()
    labels[::3, :2] = -100  # a different number of counted tokens per sample
    return [{"input_ids": i, "labels": t} for i, t in zip(ids, labels, strict=True)]


#: a DeepSpeed ZeRO-2 config with the Trainer's "auto" values: DeepSpeed's engine on
#: Accelerate, its native mapping (shard(reshard_after_forward=False)) on shardwise
ZERO2 = {"deepspeed": {"zero_optimization": {"stage": 2}, "train_batch_size": "auto",
                       "train_micro_batch_size_per_gpu": "auto", "gradient_clipping": "auto",
                       "gradient_accumulation_steps": "auto", "bf16": {"enabled": "auto"}}}
