"""Helpers shared by the tests and their torchrun workers: tiny megatron-core models on CPU."""

from __future__ import annotations

import os
import socket

import torch
import torch.nn.functional as F

from mixln_megatron.dev import cpu

VOCAB = 128
SEQ = 16


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(tp: int = 1, pp: int = 1, vpp=None, seed: int = 1234, **kwargs):
    """gloo process group (single process when not under torchrun) + megatron parallel state."""
    cpu.enable()
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    if not torch.distributed.is_initialized():
        if "RANK" in os.environ:  # under torchrun
            torch.distributed.init_process_group(backend="gloo")
        else:  # one process: a file store, no TCP port to race for
            import tempfile

            store = torch.distributed.FileStore(tempfile.mktemp(prefix="mixln_store_"), 1)
            torch.distributed.init_process_group(backend="gloo", store=store, rank=0, world_size=1)
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(tp, pp, virtual_pipeline_model_parallel_size=vpp, **kwargs)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def tiny_config(num_layers=4, hidden=64, heads=4, query_groups=None, tp=1, pp=1, vpp=None, **overrides):
    from megatron.core.transformer.transformer_config import TransformerConfig

    cfg = dict(
        num_layers=num_layers, hidden_size=hidden, num_attention_heads=heads,
        num_query_groups=query_groups, ffn_hidden_size=hidden * 2,
        use_cpu_initialization=True, normalization="RMSNorm", gated_linear_unit=True,
        activation_func=F.silu, add_bias_linear=False, params_dtype=torch.float32,
        pipeline_dtype=torch.float32, tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vpp,
        attention_dropout=0.0, hidden_dropout=0.0, bias_dropout_fusion=False,
        apply_rope_fusion=False, gradient_accumulation_fusion=False, persist_layer_norm=False,
        masked_softmax_fusion=False, bias_activation_fusion=False, deallocate_pipeline_outputs=True,
    )
    cfg.update(overrides)
    return TransformerConfig(**cfg)


def build_gpt(config, spec, vp_stage=None, pre_process=None, post_process=None, vocab=VOCAB, untie=False):
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel

    if pre_process is None:
        pre_process = ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage)
    if post_process is None:
        post_process = ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)
    return GPTModel(
        config=config, transformer_layer_spec=spec, vocab_size=vocab, max_sequence_length=SEQ,
        position_embedding_type="rope", pre_process=pre_process, post_process=post_process,
        share_embeddings_and_output_weights=not untie, vp_stage=vp_stage,
    )


def batch(seed=7, b=2, s=SEQ, vocab=VOCAB):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (b, s), generator=g)
    labels = torch.roll(ids, -1, dims=1)
    pos = torch.arange(s).unsqueeze(0).expand(b, s)
    mask = torch.triu(torch.ones(1, 1, s, s, dtype=torch.bool), 1)
    return ids, labels, pos, mask
