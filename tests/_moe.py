# Tiny mixture-of-experts models of three Transformers families and one of our own.
"""Pure helpers of the expert-parallel tests (tests/unit/test_expert_parallel_setup.py and
tests/distributed/test_expert_parallel.py): nothing here starts a process."""

import torch
from torch import nn


def moe(kind, seed=0):
    """A tiny MoE language model: ``qwen3`` (8 experts, top-2, stacked gate_up/down;
    ``qwen3_two``: 2 experts, top-1),
    ``mixtral`` (4 experts), ``gptoss`` (4 experts with biases, interleaved gate/up and its
    clamped SwiGLU, its own forward's argument names), ``own`` and ``own_skewed``
    (:class:`OwnMoE`)."""
    import transformers as T

    torch.manual_seed(seed)
    if kind in ("own", "own_skewed"):
        return OwnMoE(skewed=kind == "own_skewed")
    common = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=32, num_experts_per_tok=2)
    if kind == "qwen3":
        return T.Qwen3MoeForCausalLM(T.Qwen3MoeConfig(
            **common, intermediate_size=64, moe_intermediate_size=16, num_experts=8, head_dim=8,
            attn_implementation="sdpa"))
    if kind == "qwen3_dense_first":  # layer 0 a dense MLP: a pipeline stage without experts
        return T.Qwen3MoeForCausalLM(T.Qwen3MoeConfig(
            **common, intermediate_size=64, moe_intermediate_size=16, num_experts=8, head_dim=8,
            mlp_only_layers=[0], attn_implementation="sdpa"))
    if kind == "qwen3_two":  # 2 experts, top-1: fewer a rank than replicas on 4 ranks at ep=2
        return T.Qwen3MoeForCausalLM(T.Qwen3MoeConfig(
            **{**common, "num_experts_per_tok": 1}, intermediate_size=64,
            moe_intermediate_size=16, num_experts=2, head_dim=8, attn_implementation="sdpa"))
    if kind == "mixtral":
        return T.MixtralForCausalLM(T.MixtralConfig(
            **common, intermediate_size=16, num_local_experts=4, attn_implementation="sdpa"))
    if kind == "gptoss":
        return T.GptOssForCausalLM(T.GptOssConfig(
            **common, intermediate_size=16, num_local_experts=4, head_dim=8,
            attn_implementation="eager", sliding_window=8,
            layer_types=["full_attention"] * 2))
    raise ValueError(kind)


class OwnExperts(nn.Module):
    """Experts of our own: ``forward(hidden_states, top_k_index, top_k_weights)``."""

    def __init__(self, experts=4, width=16, inner=8):
        super().__init__()
        self.num_experts = experts
        self.up = nn.Parameter(torch.randn(experts, inner, width) * 0.2)
        self.down = nn.Parameter(torch.randn(experts, width, inner) * 0.2)

    def forward(self, hidden_states, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden_states)
        for expert in range(self.num_experts):
            rows, choice = torch.where(top_k_index == expert)
            if rows.numel():
                h = torch.relu(hidden_states[rows] @ self.up[expert].T) @ self.down[expert].T
                out.index_add_(0, rows, h * top_k_weights[rows, choice, None])
        return out


class OwnMoE(nn.Module):
    """Embedding, one routed MoE layer (top-2 of 4), a head; returns ``.loss`` as
    Transformers models do. ``skewed``: every token picks experts 0 and 1 (on 2 ranks, the
    second rank's experts get no token)."""

    def __init__(self, skewed=False):
        super().__init__()
        self.skewed = skewed
        self.embed = nn.Embedding(64, 16)
        self.router = nn.Linear(16, 4, bias=False)
        self.experts = OwnExperts()
        self.head = nn.Linear(16, 64)

    def forward(self, input_ids, labels=None):
        from types import SimpleNamespace

        x = self.embed(input_ids)
        flat = x.reshape(-1, 16)
        weights, index = torch.topk(torch.softmax(self.router(flat), dim=-1), 2, dim=-1)
        if self.skewed:
            index = torch.tensor([0, 1]).expand_as(index)
        x = x + self.experts(flat, index, weights).reshape(x.shape)
        logits = self.head(x)
        loss = nn.functional.cross_entropy(logits.reshape(-1, 64), labels.reshape(-1))
        return SimpleNamespace(loss=loss, logits=logits)


def token_batches(count=3, rows=4, seed=1):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 64, (rows, 8), generator=generator) for _ in range(count)]
