"""convert.mapping.HF_NORM_MODULES against the HF model code: each role's HF module runs where the role says.

The conversion and the Bridge take every norm's HF name from that one table; a round trip cannot
tell two names swapped (norms start at ones, and both directions would swap alike), so the table is
checked here by the order in which the HF decoder layer of each kind calls its modules.
"""

import pytest
import torch

pytest.importorskip("transformers")

from mixln_megatron.hf import MixLNLlamaConfig, MixLNLlamaForCausalLM  # noqa: E402
from mixln_megatron.convert.mapping import HF_NORM_MODULES, NORM_A, NORM_B, NORM_C, NORM_D  # noqa: E402

KINDS = ["deepnorm", "sandwich", "post", "pre"]
ATTN, MLP = "self_attn", "mlp"
# What each role means (convert.mapping.HF_NORM_MODULES), as the order of one layer's calls.
ROLE_ORDER = {
    "pre": [NORM_A, ATTN, NORM_B, MLP],
    "sandwich": [NORM_A, ATTN, NORM_C, NORM_B, MLP, NORM_D],  # N_b on the attention output, N_d on the MLP's
    "post": [ATTN, NORM_B, MLP, NORM_A],  # N1 after the attention residual add, N2 after the MLP's
    "deepnorm": [ATTN, NORM_B, MLP, NORM_A],
}


def test_every_kind_has_a_role_order():
    assert set(ROLE_ORDER) == set(HF_NORM_MODULES)
    for kind, order in ROLE_ORDER.items():
        assert set(order) - {ATTN, MLP} == set(HF_NORM_MODULES[kind]), kind


def test_each_norm_role_names_the_hf_module_called_in_its_place():
    alpha, beta = (2 * len(KINDS)) ** 0.25, (8 * len(KINDS)) ** -0.25
    cfg = MixLNLlamaConfig(
        vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=len(KINDS), num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32, layer_kinds=KINDS,
        post_ln_layers=sum(k in ("post", "deepnorm") for k in KINDS), deepnorm_alpha=alpha, deepnorm_beta=beta)
    model = MixLNLlamaForCausalLM(cfg).eval()
    calls = []
    for index, layer in enumerate(model.model.layers):
        for name, module in layer.named_children():
            module.register_forward_hook(lambda *_, index=index, name=name: calls.append((index, name)))
    with torch.no_grad():
        model(torch.arange(1, 9).unsqueeze(0))
    for index, kind in enumerate(KINDS):
        expected = [r if r in (ATTN, MLP) else HF_NORM_MODULES[kind][r] for r in ROLE_ORDER[kind]]
        called = [name for i, name in calls if i == index]
        assert called == expected, (kind, called, expected)
