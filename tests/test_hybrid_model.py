"""HybridModel Mix-LN is the GPTModel Mix-LN network.

A `*-*-...` HybridModel of L = 4 blocks (8 hybrid layers) with the GPT model's weights, mapped
name for name (harness.testing.hybrid_key), gives the same logits and the same gradient
of every parameter as GPTModel Mix-LN, for P = 0, 2, L and the lns / mixln+lns schemes. Its layers
are numbered by transformer block, hold one norm each where the block's norm belongs (checked
against a functional reference per layer), and name it with the GPT model's (block, role).
Patterns Mix-LN does not define are refused with the layer and the reason, by the pattern module,
the spec factory and HybridModel with the `--spec` objects; the edge prints one ERROR line.
TP2 and PP2 with `|` splits (even, uneven, inside a block) reproduce the single-process GPT
reference (2 processes, tests/workers/hybrid_worker.py).
"""

import os
import re

import pytest
import torch
import torch.nn.functional as F

from mixln_megatron import compat
from harness import testing as mu

needs_hybrid = pytest.mark.skipif(not compat.HYBRID_MODEL, reason="HybridModel Mix-LN needs megatron-core 0.19+")
pytestmark = needs_hybrid
L = 4
PATTERN = "*-" * L
WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "workers", "hybrid_worker.py")


def gpt_model(p, scheme=None, layout=None):
    from mixln_megatron.spec import get_mixln_decoder_block_spec

    cfg = mu.tiny_config(num_layers=L)
    model = mu.build_gpt(cfg, get_mixln_decoder_block_spec(cfg, backend="local", post_ln_layers=p, scheme=scheme,
                                                           layout=layout))
    mu.randomize([model])  # norm weights away from 1, N1 != N2
    return model


def hybrid_model(p, scheme=None, pattern=PATTERN, layout=None):
    from mixln_megatron.spec import get_mixln_hybrid_stack_spec

    cfg = mu.tiny_config(num_layers=len(pattern.replace("|", "")))
    spec = get_mixln_hybrid_stack_spec(cfg, backend="local", post_ln_layers=p, scheme=scheme,
                                       hybrid_layer_pattern=pattern, layout=layout)
    model = mu.build_hybrid(cfg, spec, pattern)
    mu.randomize([model], seed=11)  # other values than the GPT model's, so a tensor not loaded shows
    return model


def twins(p, scheme=None, layout=None):
    """(GPT model, HybridModel loaded strictly with the GPT model's weights)."""
    gpt, hyb = gpt_model(p, scheme, layout), hybrid_model(p, scheme, layout=layout)
    hyb.load_state_dict(mu.hybrid_state_dict(gpt), strict=True)
    return gpt, hyb


def logits_and_grads(model):
    ids, labels, pos, mask = mu.batch()
    model.zero_grad()
    logits = model(ids, pos, mask)
    F.cross_entropy(logits.float().flatten(0, 1), labels.flatten()).backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def assert_same_network(gpt, hyb):
    """Equal logits and the same gradient of every parameter (each non-zero: every one takes part)."""
    gpt_logits, gpt_grads = logits_and_grads(gpt)
    hyb_logits, hyb_grads = logits_and_grads(hyb)
    assert torch.equal(hyb_logits, gpt_logits)
    gpt_grads = {mu.hybrid_key(n): g for n, g in gpt_grads.items()}
    assert sorted(hyb_grads) == sorted(gpt_grads)
    for name, grad in gpt_grads.items():
        assert grad.abs().max() > 0, name
        assert torch.equal(hyb_grads[name], grad), name


def norm_by_block_role(model) -> dict:
    """{(block, role): parameter} of every layer's norms: the name both model kinds share."""
    return {(layer.block_number, role): p for layer in model.decoder.layers for role, p in layer.norm_parameters()}


# ------------------------------------------------------------------ the same network
@pytest.mark.compat
@pytest.mark.parametrize("scheme,p", [("mixln", 0), ("mixln", 2), ("mixln", L), ("lns", 0), ("mixln+lns", 2)])
def test_same_logits_and_gradients_as_the_gpt_model(mcore_single, scheme, p):
    gpt, hyb = twins(p, scheme)
    assert [l.is_post_ln for l in hyb.decoder.layers] == [k <= p for k in range(1, L + 1) for _ in "*-"]
    assert_same_network(gpt, hyb)


# The paper's comparison arms, every kind in one model and each alone: DeepNorm's residual scale
# and Sandwich's output norms sit in the residual step of the half that has it.
ARM_LAYOUTS = ["deepnorm:1,sandwich:2,post:3,pre:4", "deepnorm:1-2,pre:3-", "sandwich:*", "post:every2,sandwich:*"]


@pytest.mark.compat
@pytest.mark.parametrize("layout", ARM_LAYOUTS)
def test_every_layer_kind_is_the_gpt_models_network(mcore_single, layout):
    from mixln_megatron.model.layout import POST_LN_KINDS, SANDWICH, parse_layout

    kinds = parse_layout(layout, L, "the test")
    gpt, hyb = twins(None, layout=layout)
    assert [l.kind for l in hyb.decoder.layers] == [k for k in kinds for _ in "*-"]
    assert [l.is_post_ln for l in hyb.decoder.layers] == [k in POST_LN_KINDS for k in kinds for _ in "*-"]
    for layer in hyb.decoder.layers:  # a sandwich block's N_b in its `*` layer, N_d in its `-` layer
        sandwich = layer.kind == SANDWICH
        assert (getattr(layer, "attn_output_layernorm", None) is not None) == (sandwich and layer.hybrid_part == "attention")
        assert (getattr(layer, "mlp_output_layernorm", None) is not None) == (sandwich and layer.hybrid_part == "mlp")
    assert_same_network(gpt, hyb)
    # (block, role) names the same norm in both models, sandwich's norm3 / norm4 included
    gpt_norms, hyb_norms = norm_by_block_role(gpt), norm_by_block_role(hyb)
    assert sorted(gpt_norms) == sorted(hyb_norms)
    for key, param in gpt_norms.items():
        assert torch.equal(hyb_norms[key], param), key


@pytest.mark.compat
@pytest.mark.parametrize("scheme", ["lns", "mixln+lns"])
def test_layernorm_scaling_counts_blocks_not_hybrid_layers(mcore_single, scheme):
    """LNS scales a Pre-LN block's norms by 1/sqrt(block), in both of the block's hybrid layers."""
    p = 0 if scheme == "lns" else 1
    _, hyb = twins(p, scheme)
    for layer in hyb.decoder.layers:
        expected = 1.0 if layer.block_number <= p else layer.block_number ** -0.5
        assert layer.norm_output_scale == pytest.approx(expected), layer.layer_number


# ------------------------------------------------------------------ layers, norms and their roles
def expected_norm_modules(p):
    """The Mix-LN norms a `*-` model of L blocks holds, by module name: per block one in each layer."""
    names = []
    for block in range(1, L + 1):
        attention, mlp = 2 * block - 2, 2 * block - 1  # 0-based hybrid layers of the block
        if block <= p:
            names += [f"layers.{attention}.post_attention_layernorm", f"layers.{mlp}.post_mlp_layernorm"]
        else:
            names += [f"layers.{attention}.input_layernorm", f"layers.{mlp}.pre_mlp_layernorm"]
    return names + ["final_norm"]


@pytest.mark.compat
@pytest.mark.parametrize("p", [0, 2, L])
def test_layers_numbered_by_block_with_one_norm_each(mcore_single, p):
    from megatron.core.transformer.identity_op import IdentityOp

    from mixln_megatron.model.backends import MixLNNorm

    hyb = hybrid_model(p)
    layers = hyb.decoder.layers
    assert [(l.layer_number, l.block_number, l.hybrid_part, l.is_post_ln) for l in layers] == [
        (n, (n + 1) // 2, "attention" if n % 2 else "mlp", (n + 1) // 2 <= p) for n in range(1, 2 * L + 1)]
    assert [name for name, m in hyb.decoder.named_modules() if isinstance(m, MixLNNorm)] == expected_norm_modules(p)
    assert isinstance(hyb.decoder.final_norm, MixLNNorm)
    for layer in layers:
        attention = layer.hybrid_part == "attention"
        # the half a layer does not have is megatron's IdentityOp
        assert isinstance(layer.mlp if attention else layer.self_attention, IdentityOp)
        assert not isinstance(layer.self_attention if attention else layer.mlp, IdentityOp)
        if layer.is_post_ln:  # `*` only N1, `-` only N2; no norm before F
            own, absent = ("post_attention_layernorm", "post_mlp_layernorm")[::1 if attention else -1]
            assert isinstance(getattr(layer, own), MixLNNorm) and getattr(layer, absent) is None
            assert isinstance(layer.input_layernorm, IdentityOp) and isinstance(layer.pre_mlp_layernorm, IdentityOp)
            norm = getattr(layer, own)
        else:  # the stock Pre-LN norm of the half
            own, other = ("input_layernorm", "pre_mlp_layernorm")[::1 if attention else -1]
            assert isinstance(getattr(layer, own), MixLNNorm) and isinstance(getattr(layer, other), IdentityOp)
            assert getattr(layer, "post_attention_layernorm", None) is None
            assert getattr(layer, "post_mlp_layernorm", None) is None
            norm = getattr(layer, own)
        role = "norm1.weight" if attention else "norm2.weight"
        assert [(r, id(q)) for r, q in layer.norm_parameters()] == [(role, id(norm.weight))], layer.layer_number


@pytest.mark.compat
@pytest.mark.parametrize("p", [0, 2, L])
def test_block_and_role_name_the_same_norm_in_both_models(mcore_single, p):
    gpt, hyb = twins(p)
    gpt_norms, hyb_norms = norm_by_block_role(gpt), norm_by_block_role(hyb)
    assert sorted(hyb_norms) == sorted(gpt_norms) == [(k, f"norm{i}.weight") for k in range(1, L + 1) for i in (1, 2)]
    for key, weight in gpt_norms.items():
        assert torch.equal(hyb_norms[key], weight), key
    assert len({tuple(w.tolist()) for w in gpt_norms.values()}) == 2 * L  # all distinct: a swap would show


# ------------------------------------------------------------------ where N1 and N2 sit
def rms(x, weight, scale=1.0, eps=1e-5):
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight * scale


def record_layer_io(model):
    """Forward hooks: per hybrid layer its input x, output y, and its F's (attention / MLP) input and output."""
    seen, handles = {}, []

    def first(value):
        return value[0] if isinstance(value, tuple) else value

    for layer in model.decoder.layers:
        n = layer.layer_number
        f = layer.self_attention if layer.hybrid_part == "attention" else layer.mlp

        def layer_in(_m, args, kwargs, n=n):
            seen.setdefault(n, {})["x"] = (args[0] if args else kwargs["hidden_states"]).detach()

        def layer_out(_m, _args, output, n=n):
            seen[n]["y"] = first(output).detach()

        def f_in(_m, args, kwargs, n=n):
            seen[n]["f_in"] = (args[0] if args else kwargs["hidden_states"]).detach()

        def f_out(_m, _args, output, n=n):
            seen[n]["f_out"] = first(output).detach()

        handles += [layer.register_forward_pre_hook(layer_in, with_kwargs=True), layer.register_forward_hook(layer_out),
                    f.register_forward_pre_hook(f_in, with_kwargs=True), f.register_forward_hook(f_out)]
    return seen, handles


@pytest.mark.compat
@pytest.mark.parametrize("scheme,p", [("mixln", 2), ("mixln+lns", 1)])
def test_each_hybrid_layer_applies_its_blocks_norm_where_it_belongs(mcore_single, scheme, p):
    """A functional reference per hybrid layer, with the GPT model's norm weights by role:
    block k Post-LN: layer 2k-1 y = N1(x + Attn(x)), layer 2k y = N2(h + MLP(h));
    block k Pre-LN:  layer 2k-1 y = x + Attn(N1(x)), layer 2k y = h + MLP(N2(h)) (N scaled by LNS)."""
    gpt, hyb = twins(p, scheme)
    seen, handles = record_layer_io(hyb)
    ids, _, pos, mask = mu.batch()
    with torch.no_grad():
        hyb(ids, pos, mask)
    for h in handles:
        h.remove()
    for layer in hyb.decoder.layers:
        gpt_layer = gpt.decoder.layers[layer.block_number - 1]
        attention = layer.hybrid_part == "attention"
        io = seen[layer.layer_number]
        tol = dict(rtol=1e-5, atol=1e-5)
        if layer.is_post_ln:
            norm = gpt_layer.post_attention_layernorm if attention else gpt_layer.post_mlp_layernorm
            torch.testing.assert_close(io["f_in"], io["x"], rtol=0, atol=0)
            torch.testing.assert_close(io["y"], rms(io["x"] + io["f_out"], norm.weight), **tol)
        else:
            norm = gpt_layer.input_layernorm if attention else gpt_layer.pre_mlp_layernorm
            torch.testing.assert_close(io["f_in"], rms(io["x"], norm.weight, layer.block_number ** -0.5
                                                       if scheme != "mixln" else 1.0), **tol)
            torch.testing.assert_close(io["y"], io["x"] + io["f_out"], **tol)


@pytest.mark.compat
def test_swapping_n1_and_n2_changes_the_logits(mcore_single):
    """The equality above sees the placement: N1 and N2 of each Post-LN block swapped in the
    HybridModel give other logits than the GPT model."""
    gpt, hyb = twins(2)
    state = mu.hybrid_state_dict(gpt)
    for block in (1, 2):
        n1 = f"decoder.layers.{2 * block - 2}.post_attention_layernorm.weight"
        n2 = f"decoder.layers.{2 * block - 1}.post_mlp_layernorm.weight"
        state[n1], state[n2] = state[n2], state[n1]
    hyb.load_state_dict(state, strict=True)
    gpt_logits, _ = logits_and_grads(gpt)
    hyb_logits, _ = logits_and_grads(hyb)
    assert (hyb_logits - gpt_logits).abs().max() > 1e-3


# ------------------------------------------------------------------ patterns Mix-LN refuses
REASON_WRONG_PART = r"'-' where '\*' belongs"
REFUSED = {  # pattern: (what the message names, the reason)
    "*--*": ("layer 3", REASON_WRONG_PART),
    "-*-*": ("layer 1", REASON_WRONG_PART),
    "*-M-": ("layer 3", r"'M' \(Mamba\)"),
    "*-E-": ("layer 3", r"'E' \(MoE\)"),
    # megatron itself refuses '*' next to '+' or 'D' ("Attention and MLA/DSA in one model")
    "+-+-": ("layer 1", r"'\+' \(multi-latent attention\)"),
    "D-": ("layer 1", r"'D' \(DeepSeek sparse attention\)"),
    "G-*-": ("layer 1", r"'G' \(gated delta net\)"),
    "*-*": ("3 layers", r"3 layers, (not whole blocks|an odd number)"),
    "*-*-/*-": ("multi-token", r"multi-token.prediction"),
}
ACCEPTED = {"*-": 1, "*-*-": 2, "*-|*-": 2, "*-*|-*-": 3, "*-*-|*-*-": 4, "*|-*-|*-": 3}


def model_from_spec_object(pattern, **cfg_overrides):
    """HybridModel with the `--spec mixln_megatron.spec mixln_hybrid_local_stack_spec` object."""
    from mixln_megatron.spec import mixln_hybrid_local_stack_spec

    main = pattern.split("/")[0].replace("|", "")
    cfg = mu.tiny_config(num_layers=len(main), **cfg_overrides)
    return mu.build_hybrid(cfg, mixln_hybrid_local_stack_spec, pattern)


@pytest.fixture
def megatron_lm_args(monkeypatch):
    """Set Megatron-LM's parsed args (what pretrain_hybrid.py has when it builds the model)."""
    import argparse

    global_vars = pytest.importorskip("megatron.training.global_vars")

    def set_args(**values):
        monkeypatch.setattr(global_vars, "_GLOBAL_ARGS", argparse.Namespace(**values))

    set_args()
    return set_args


@pytest.fixture
def no_megatron_lm_args(monkeypatch):
    """No Megatron-LM run (a megatron-core user): the --spec objects read the environment."""
    import sys

    global_vars = sys.modules.get("megatron.training.global_vars")
    if global_vars is not None:
        monkeypatch.setattr(global_vars, "_GLOBAL_ARGS", None)


@pytest.fixture
def fresh_reports(monkeypatch):
    """The build line is printed once per process: start from none printed (the ERROR line is
    printed once per error)."""
    from mixln_megatron.model import support

    monkeypatch.setattr(support, "_announced", set())


@pytest.mark.compat
@pytest.mark.parametrize("pattern", sorted(REFUSED))
def test_pattern_module_and_spec_factory_refuse(pattern):
    from mixln_megatron.model import hybrid_pattern
    from mixln_megatron.model.support import MixLNUnsupportedError
    from mixln_megatron.spec import get_mixln_hybrid_stack_spec

    names, reason = REFUSED[pattern]
    for refuse in (hybrid_pattern.check_pattern,
                   lambda p: get_mixln_hybrid_stack_spec(backend="local", hybrid_layer_pattern=p)):
        with pytest.raises(MixLNUnsupportedError) as caught:
            refuse(pattern)
        message = str(caught.value)
        assert names in message and re.search(reason, message), message
    assert hybrid_pattern.pattern_problem(pattern) == message


@pytest.mark.compat
@pytest.mark.parametrize("pattern", sorted(REFUSED))
def test_hybrid_model_with_the_spec_object_refuses(mcore_single, no_megatron_lm_args, fresh_reports, pattern, capsys):
    """Without Megatron-LM's args (a megatron-core user) the stack checks its own stage's part;
    MTP needs mtp_num_layers in the config to be built at all, and the stack refuses it."""
    from mixln_megatron.model.support import MixLNUnsupportedError

    names, reason = REFUSED[pattern]
    mtp = {"mtp_num_layers": 1} if "/" in pattern else {}
    with pytest.raises(SystemExit) as caught:  # the --spec object is an edge: one line, exit 2
        model_from_spec_object(pattern, **mtp)
    assert caught.value.code == 2 and isinstance(caught.value.error, MixLNUnsupportedError)
    assert names in str(caught.value) and re.search(reason, str(caught.value)), str(caught.value)
    lines = [l for l in capsys.readouterr().err.splitlines() if l.startswith("[mixln_megatron] ERROR:")]
    assert len(lines) == 1 and names in lines[0] and re.search(reason, lines[0]), lines


@pytest.mark.compat
@pytest.mark.parametrize("pattern", sorted(REFUSED))
def test_spec_object_checks_megatron_lms_whole_pattern(mcore_single, megatron_lm_args, fresh_reports, pattern,
                                                       capsys):
    """Under pretrain_hybrid.py the edge checks args.hybrid_layer_pattern as a whole, before any layer."""
    from mixln_megatron.model.support import MixLNUnsupportedError

    megatron_lm_args(hybrid_layer_pattern=pattern)
    names, reason = REFUSED[pattern]
    with pytest.raises(SystemExit) as caught:
        model_from_spec_object(pattern)
    assert caught.value.code == 2 and isinstance(caught.value.error, MixLNUnsupportedError)
    assert names in str(caught.value) and re.search(reason, str(caught.value)), str(caught.value)
    captured = capsys.readouterr()
    lines = [l for l in captured.err.splitlines() if l.startswith("[mixln_megatron] ERROR:")]
    assert len(lines) == 1 and repr(pattern) in lines[0] and re.search(reason, lines[0]), lines
    assert "[mixln_megatron] scheme=" not in captured.out  # refused before the build line


@pytest.mark.compat
def test_segments_that_do_not_match_the_pipeline_are_refused(mcore_single, no_megatron_lm_args, fresh_reports,
                                                              capsys):
    """At PP1 megatron reads "*-|*-" as two virtual stages and builds the first only; refused."""
    from mixln_megatron.model.support import MixLNUnsupportedError

    with pytest.raises(SystemExit, match="ends at hybrid layer 2, but the model has 4 layers") as caught:
        model_from_spec_object("*-|*-")
    assert caught.value.code == 2 and isinstance(caught.value.error, MixLNUnsupportedError)
    lines = [l for l in capsys.readouterr().err.splitlines() if l.startswith("[mixln_megatron] ERROR:")]
    assert len(lines) == 1 and lines[0].endswith("(x virtual pipeline) stages"), lines


@pytest.mark.compat
@pytest.mark.parametrize("pattern", sorted(ACCEPTED))
def test_pipeline_splits_are_accepted(pattern):
    from mixln_megatron.model import hybrid_pattern
    from mixln_megatron.spec import get_mixln_hybrid_stack_spec

    assert hybrid_pattern.pattern_problem(pattern) is None
    assert hybrid_pattern.check_pattern(pattern) == ACCEPTED[pattern]
    get_mixln_hybrid_stack_spec(backend="local", hybrid_layer_pattern=pattern)


@pytest.mark.compat
@pytest.mark.parametrize("env,pattern,line", [
    ({"MIXLN_POST_LN_LAYERS": "1"}, "*-*-", "[mixln_megatron] scheme=mixln L=2 P=1 alpha=n/a (P given directly) "
                                            "(from MIXLN_POST_LN_LAYERS); Post-LN layers: 1"),
    ({"MIXLN_ALPHA": "0.5"}, "*-*-*-*-", "[mixln_megatron] scheme=mixln L=4 P=2 alpha=0.5 (from MIXLN_ALPHA); "
                                         "Post-LN layers: 1, 2"),
])
def test_spec_object_builds_mixln_and_prints_the_build_line_once(mcore_single, megatron_lm_args, fresh_reports,
                                                                monkeypatch, capsys, env, pattern, line):
    from mixln_megatron.model.hybrid import MixLNHybridStack
    from mixln_megatron.model.backends import MixLNNorm

    for name, value in env.items():
        monkeypatch.setenv(name, value)
    megatron_lm_args(hybrid_layer_pattern=pattern)
    model = model_from_spec_object(pattern)
    p = int(line.split(" P=")[1].split()[0])
    assert type(model.decoder) is MixLNHybridStack and isinstance(model.decoder.final_norm, MixLNNorm)
    assert [l.is_post_ln for l in model.decoder.layers] == [l.block_number <= p for l in model.decoder.layers]
    assert len(model.decoder.layers) == len(pattern)
    captured = capsys.readouterr()
    assert [l for l in captured.out.splitlines() if l.startswith("[mixln_megatron] scheme=")] == [line]
    assert "[mixln_megatron] ERROR:" not in captured.err
    model_from_spec_object(pattern)  # a second model of the same placement: no second line
    assert "[mixln_megatron] scheme=" not in capsys.readouterr().out


# ------------------------------------------------------------------ TP2 and PP2 (2 processes)
LAYOUTS = {  # layout: (pattern, the global hybrid layers each rank builds)
    "tp2": (PATTERN, [list(range(1, 9)), list(range(1, 9))]),
    "pp2_even": ("*-*-|*-*-", [[1, 2, 3, 4], [5, 6, 7, 8]]),
    "pp2_uneven": ("*-|*-*-*-", [[1, 2], [3, 4, 5, 6, 7, 8]]),
    "pp2_inside_block": ("*-*|-*-*-", [[1, 2, 3], [4, 5, 6, 7, 8]]),
}
REL = 1e-5


@pytest.fixture(scope="module")
def parallel_results(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("hybrid")
    return mu.last_result(mu.torchrun(WORKER, 2, "--workdir", workdir, env={"OMP_NUM_THREADS": "1"}))


@pytest.mark.mp
def test_every_parallel_layout_ran(parallel_results):
    assert sorted(parallel_results["layouts"]) == sorted(LAYOUTS)
    ref = parallel_results["reference"]
    assert ref["twin_loss"] == ref["loss"]  # the TP1 hybrid twin the checkpoint holds is the GPT model


@pytest.mark.mp
@pytest.mark.parametrize("layout", LAYOUTS)
def test_parallel_layout_is_the_single_process_gpt_network(parallel_results, layout):
    ref, got = parallel_results["reference"], parallel_results["layouts"][layout]
    pattern, stage_layers = LAYOUTS[layout]
    assert got["pattern"] == pattern and got["stage_layers"] == stage_layers
    # the same layers, numbered and placed by block, spread over the stages the pattern says
    assert got["layers"] == [[n, (n + 1) // 2, "attention" if n % 2 else "mlp", (n + 1) // 2 <= 2]
                             for n in range(1, 2 * L + 1)]
    assert len(got["losses_on_last_stage_ranks"]) == (2 if layout == "tp2" else 1)
    for loss in got["losses_on_last_stage_ranks"]:
        assert abs(loss - ref["loss"]) <= REL * abs(ref["loss"]), (loss, ref["loss"])
    assert got["logits_max_diff"] <= REL * ref["logits_max_abs"], got["logits_max_diff"]
    assert sorted(got["norm_grads"]) == sorted(ref["norm_grads"])  # every norm, final included
    for name, diff in got["norm_grads"].items():
        assert diff <= 1e-4 * ref["norm_grads"][name], (name, diff, ref["norm_grads"][name])
