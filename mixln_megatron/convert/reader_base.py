"""What every Megatron checkpoint reader offers (torch_dist_reader, legacy_reader)."""

from __future__ import annotations

from typing import Optional

import torch

from ..errors import ConversionError


class ReaderBase:
    format = "?"
    label = ""
    path = ""
    args = None
    iteration = None
    content_metadata: Optional[dict] = None
    settings_record: Optional[dict] = None  # the sharded / legacy record
    # torch_dist: "mixln" when the norms are stored under the Mix-LN keys, "stock" otherwise;
    # legacy files name modules, not keys (None).
    norm_layout: Optional[str] = None
    dtype = torch.float32
    padded_vocab_size = 0
    has_output_layer = True

    def refuse_unconvertible(self, moe: bool = False) -> None:
        """UnsupportedModelError when the layers hold what a conversion cannot carry (MLA, MTP; MoE
        unless `moe`: to-hf and inspect carry experts); reading the settings and metadata of such a
        checkpoint still works."""

    def _require_args(self):
        if self.args is None:
            raise ConversionError(
                f"{self.path} carries no Megatron args (saved without them?): the model shape cannot be read"
            )

    def check_layer_kinds(self, kinds) -> None:
        """The tensors agree with the settings' layer kinds (model.layout: one per layer), as far as
        the format can tell: legacy files name each layer's norm modules, torch_dist stacks the
        sandwich norms over the sandwich layers."""

    def vocab_blocks(self, which: str, rows: int):
        """Row blocks in which the embedding / output layer is read (default: all rows at once)."""
        return [(0, rows)]


