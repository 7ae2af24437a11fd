"""Megatron's role tensors (global layout), computed on demand from an HF folder's tensors.

Both writers ask for rows of a role; only the HF rows they come from are read, so import
memory stays bounded by one piece, whatever the model size.
"""

from __future__ import annotations

from typing import Dict

import torch

from ..errors import ConversionError
from ..model import qkv_layout
from . import mapping as M
from .hf_folder import HFCheckpoint
from .shape import ModelShape


class HFRoleSource:
    """Megatron role tensors (global layout) computed from the HF tensors, on demand."""

    def __init__(self, hf: HFCheckpoint, shape: ModelShape, kinds, stock_source: bool, dtype,
                 moe_style: str = "qwen2_moe"):
        """`kinds`: every layer's kind (model.layout), or an integer P for Mix-LN's first P post layers;
        `moe_style`: the MoE layers' HF names (mapping.MOE_STYLES: mixtral or the Qwen2-MoE hub names)."""
        from ..model.layout import POST_LN_KINDS, first_p_kinds, sandwich_rows

        if isinstance(kinds, int):
            kinds = first_p_kinds(shape.num_layers, kinds)
        self.hf, self.shape, self.kinds, self.stock_source, self.dtype = hf, shape, tuple(kinds), stock_source, dtype
        self.moe_style = moe_style
        self.post_ln = sum(k in POST_LN_KINDS for k in self.kinds)
        # a sandwich layer's row of the norms stacked over the sandwich layers (mixln_norm_c / _d)
        self.sandwich_rows = sandwich_rows(self.kinds)

    def is_post_ln(self, layer: int) -> bool:
        from ..model.layout import POST_LN_KINDS

        return self.kinds[layer] in POST_LN_KINDS

    def layer_roles(self, layer: int):
        """The roles of layer `layer` (mapping.layer_roles of its kind)."""
        return M.layer_roles(self.shape, self.kinds[layer], layer)

    def is_moe_layer(self, layer: int) -> bool:
        return M.is_moe_layer(self.shape, layer)

    def moe_role_parts(self, role: str):
        """The HF (name, shape) pairs of an MoE role (mapping.hf_role_tensors): two for an fc1 ([gate; up])."""
        return M.hf_role_tensors(self.shape, role, None, self.moe_style)

    def hf_tensor(self, name, start=None, stop=None):
        """HF tensor `name` (rows start:stop if given) in the output dtype."""
        return self.hf.get(name, start, stop).to(self.dtype)

    def role(self, layer: int, role: str) -> torch.Tensor:
        """The whole tensor of `role` in layer `layer` (Megatron's global layout)."""
        if role in M.MOE_ROLE_NAMES or M.split_expert_role(role):
            parts = self.moe_role_parts(role)
            return torch.cat([self.hf_tensor(M.hf_layer_prefix(layer) + name) for name, _ in parts], dim=0)
        if role.startswith("fc1."):
            f = self.shape.ffn_hidden_size
            return torch.cat([self.role_rows(layer, role, 0, f), self.role_rows(layer, role, f, 2 * f)], dim=0)
        rows = self.shape.hidden_size if role in M.SANDWICH_ROLES else self.shape.megatron_layer_shapes()[role][0]
        return self.role_rows(layer, role, 0, rows)

    def role_rows(self, layer: int, role: str, start: int, stop: int) -> torch.Tensor:
        """Rows [start, stop) of that tensor, reading only the HF rows they come from.

        QKV ranges must be whole query groups and fc1 ranges must lie inside one half
        (layouts.megatron_row_chunks makes them so).
        """
        p = M.hf_layer_prefix(layer)
        if role in M.MOE_ROLE_NAMES or M.split_expert_role(role):  # one HF tensor, or [gate; up] halves
            parts = self.moe_role_parts(role)
            half = parts[0][1][0]
            if len(parts) == 2 and start < half < stop:
                raise ValueError(f"{role} rows {start}:{stop} straddle gate and up")
            name, offset = (parts[0][0], 0) if start < half or len(parts) == 1 else (parts[1][0], half)
            return self.hf_tensor(p + name, start - offset, stop - offset)
        kind = role.split(".")[1] if "." in role else None
        if role.startswith("qkv."):
            d, qpg = self.shape.kv_channels, self.shape.q_per_group
            group = qkv_layout.group_rows(qpg, d)
            if start % group or stop % group:
                raise ValueError(f"QKV rows {start}:{stop} are not whole query groups")
            g0, g1 = start // group, stop // group
            q_rows, kv_rows = qkv_layout.separate_rows(g0, g1, qpg, d)
            q = self.hf_tensor(f"{p}self_attn.q_proj.{kind}", q_rows.start, q_rows.stop)
            k = self.hf_tensor(f"{p}self_attn.k_proj.{kind}", kv_rows.start, kv_rows.stop)
            v = self.hf_tensor(f"{p}self_attn.v_proj.{kind}", kv_rows.start, kv_rows.stop)
            return qkv_layout.merge(q, k, v, g1 - g0, qpg, d)
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
        if self.is_post_ln(layer) and self.stock_source:
            return {"norm_a": "input_layernorm.weight", "norm_b": "post_attention_layernorm.weight"}
        return M.hf_norm_names(self.kinds[layer])

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
            for role in self.layer_roles(layer):
                if role in M.NORM_ROLES:
                    out[p + self.norm_source(layer)[role]] = (s.hidden_size,)
                else:
                    for name, shp in M.hf_role_tensors(s, role, False, self.moe_style):
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
