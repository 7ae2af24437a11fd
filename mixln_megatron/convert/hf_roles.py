"""Megatron's role tensors (global layout), computed on demand from an HF folder's tensors.

Both writers ask for rows of a role; only the HF rows they come from are read, so import
memory stays bounded by one piece, whatever the model size.
"""

from __future__ import annotations

import dataclasses
from typing import Dict

import torch

from ..errors import ConversionError
from . import mapping as M
from .hf_folder import HFCheckpoint
from .layouts import merge_qkv
from .shape import ModelShape


class HFRoleSource:
    """Megatron role tensors (global layout) computed from the HF tensors, on demand."""

    def __init__(self, hf: HFCheckpoint, shape: ModelShape, post_ln: int, stock_source: bool, dtype):
        self.hf, self.shape, self.post_ln, self.stock_source, self.dtype = hf, shape, post_ln, stock_source, dtype

    def hf_tensor(self, name, start=None, stop=None):
        """HF tensor `name` (rows start:stop if given) in the output dtype."""
        return self.hf.get(name, start, stop).to(self.dtype)

    def role(self, layer: int, role: str) -> torch.Tensor:
        """The whole tensor of `role` in layer `layer` (Megatron's global layout)."""
        if role.startswith("fc1."):
            f = self.shape.ffn_hidden_size
            return torch.cat([self.role_rows(layer, role, 0, f), self.role_rows(layer, role, f, 2 * f)], dim=0)
        return self.role_rows(layer, role, 0, self.shape.megatron_layer_shapes()[role][0])

    def role_rows(self, layer: int, role: str, start: int, stop: int) -> torch.Tensor:
        """Rows [start, stop) of that tensor, reading only the HF rows they come from.

        QKV ranges must be whole query groups and fc1 ranges must lie inside one half
        (layouts.megatron_row_chunks makes them so).
        """
        p = M.hf_layer_prefix(layer)
        kind = role.split(".")[1] if "." in role else None
        if role.startswith("qkv."):
            d, qpg = self.shape.kv_channels, self.shape.q_per_group
            group = (qpg + 2) * d
            if start % group or stop % group:
                raise ValueError(f"QKV rows {start}:{stop} are not whole query groups")
            g0, g1 = start // group, stop // group
            q = self.hf_tensor(f"{p}self_attn.q_proj.{kind}", g0 * qpg * d, g1 * qpg * d)
            k = self.hf_tensor(f"{p}self_attn.k_proj.{kind}", g0 * d, g1 * d)
            v = self.hf_tensor(f"{p}self_attn.v_proj.{kind}", g0 * d, g1 * d)
            part = dataclasses.replace(self.shape, num_attention_heads=(g1 - g0) * qpg, num_query_groups=g1 - g0)
            return merge_qkv(q, k, v, part)
        if role.startswith("fc1."):
            f = self.shape.ffn_hidden_size
            if start < f < stop:
                raise ValueError(f"fc1 rows {start}:{stop} straddle gate and up")
            if start < f:
                return self.hf_tensor(f"{p}mlp.gate_proj.{kind}", start, stop)
            return self.hf_tensor(f"{p}mlp.up_proj.{kind}", start - f, stop - f)
        if role.startswith("proj."):
            name = f"{p}self_attn.o_proj.{kind}"
        elif role.startswith("fc2."):
            name = f"{p}mlp.down_proj.{kind}"
        else:
            name = p + self.norm_source(layer)[role]
        return self.hf_tensor(name, start, stop)

    def norm_source(self, layer: int) -> Dict[str, str]:
        is_post = layer < self.post_ln
        if is_post and self.stock_source:
            return {"norm_a": "input_layernorm.weight", "norm_b": "post_attention_layernorm.weight"}
        return M.hf_norm_names(is_post)

    def vocab_rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows [start, stop) of the padded vocabulary: real rows from HF, zeros past the true vocab."""
        v = self.shape.vocab_size
        out = torch.zeros(stop - start, self.shape.hidden_size, dtype=self.dtype)
        if start < v:
            out[: min(stop, v) - start] = self.hf_tensor(name, start, min(stop, v))
        return out

    def expected_names(self) -> Dict[str, tuple]:
        s, out = self.shape, {}
        out[M.HF_EMBEDDING] = (s.vocab_size, s.hidden_size)
        out[M.HF_FINAL_NORM] = (s.hidden_size,)
        if not s.tie_embeddings:
            out[M.HF_OUTPUT] = (s.vocab_size, s.hidden_size)
        for layer in range(s.num_layers):
            p = M.hf_layer_prefix(layer)
            for role in M.layer_roles(s):
                if role in ("norm_a", "norm_b"):
                    out[p + self.norm_source(layer)[role]] = (s.hidden_size,)
                else:
                    for name, shp in M.hf_role_tensors(s, role, False):
                        out[p + name] = shp
        return out

    def check(self) -> None:
        problems = []
        expected = self.expected_names()
        ignored = [n for n in self.hf.weight_map if n not in expected and not n.endswith("rotary_emb.inv_freq")
                   and not (n == M.HF_OUTPUT and self.shape.tie_embeddings)]
        if ignored:
            print(f"[mixln-megatron convert] WARNING: {len(ignored)} tensor(s) of {self.hf.path} have no place in "
                  f"the Megatron model and are not converted: {', '.join(sorted(ignored)[:6])}"
                  + (" ..." if len(ignored) > 6 else ""), flush=True)
        for name, want in expected.items():
            if not self.hf.has(name):
                problems.append(f"missing {name}")
            elif tuple(self.hf.shape(name)) != tuple(want):
                problems.append(f"{name} has shape {tuple(self.hf.shape(name))}, config.json implies {tuple(want)}")
            if len(problems) > 8:
                break
        if problems:
            raise ConversionError(f"{self.hf.path} does not match its config.json: " + "; ".join(problems))
