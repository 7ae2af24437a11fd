"""Mix-LN in Megatron-Bridge (mixln_megatron.bridge), with the real Bridge on the CPU.

An exported Mix-LN folder (the project's HF model code + save_hf_folder, a tokenizer beside it)
-> AutoBridge.from_hf_pretrained(..., trust_remote_code=True) -> the Megatron GPTModel with this
package's block spec (local backend, CPU harness) -> logits equal HF's, the HF weights exported
back exactly, save_hf_pretrained -> reloads equal; the model Bridge builds has the state-dict keys
of the model this package builds itself; every layout untied and tied (tie_word_embeddings). A
parameter the load would leave unwritten (its mapping or its HF tensor gone) is refused, and so is
exporting a provider with biases the dense HF model cannot hold (add_qkv_bias, add_bias_linear). The TE backend builds, loads and exports exactly, and its
checkpoint converts back to the source folder (TE's forward needs a GPU). TP2, PP2 and PP2 x VPP2 (torchrun jobs of 2 gloo processes,
tests/workers/bridge_parallel_worker.py): the same logits through megatron's pipeline schedule and
exact export (TP2: P = 1, lns and tied lns sandwich layers; PP2 / VPP: Mix-LN + LNS with P = 3, so
a later stage holds a Post-LN layer, and the arms' layout untied and tied), then
mixln_megatron.bridge.save_megatron_checkpoint; those checkpoints are read by `mixln-megatron
convert to-hf` (the source folder again, bit for bit), and the TP2 one by `mixln-megatron pretrain
--cpu --load` (vetted, loaded at TP1, one iteration trained).

Mix-LN MoE (bridge.moe; a dense first layer, 4 experts top-2, a gated shared expert; P = 1, and
every kind with megatron's pre-softmax routing): a mixln_moe folder through AutoBridge gives HF's
logits, exports bit for bit, and its Megatron-LM checkpoint converts back to the folder; so does one
with an fp32 router (router_dtype) or a q/k/v-only bias (qkv_bias); a provider whose routing or
biases its HF config cannot describe (model.moe_fields) is refused in one line.

`make test-bridge` runs these with Bridge laid over the venv (scripts/install_bridge.sh); without
Bridge they skip, unless BRIDGE_TESTS_REQUIRED=1 (set by the make target), where they fail.
"""

import importlib.util
import os
import shutil
import sys

import pytest

pytestmark = pytest.mark.bridge
REQUIRED = os.environ.get("BRIDGE_TESTS_REQUIRED") == "1"


def _bridge_unavailable_reason():
    try:
        if importlib.util.find_spec("megatron.bridge") is None:
            return "Megatron-Bridge is not installed (make test-bridge lays it over the venv)"
    except ImportError as exc:
        return f"megatron is not importable: {exc}"
    try:
        import torch  # noqa: F401  (before TE)
        import megatron.bridge  # noqa: F401
    except Exception as exc:  # a broken overlay: a missing requirement, another transformers...
        return f"megatron.bridge does not import: {type(exc).__name__}: {str(exc)[:200]}"
    return None


REASON = _bridge_unavailable_reason()
if REASON and not REQUIRED:
    pytest.skip(REASON, allow_module_level=True)

if REASON:  # BRIDGE_TESTS_REQUIRED=1: the overlay was laid out, so this is a failure

    def test_bridge_importable():
        pytest.fail(REASON)

else:
    import torch
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    import mixln_megatron.bridge as mixln_bridge
    from megatron.bridge import AutoBridge
    from mixln_megatron import cpu
    from harness import testing
    from mixln_megatron.hf import MixLNLlamaForCausalLM, config_for_export, save_hf_folder

    TOKENIZER = os.path.join(os.path.dirname(mixln_bridge.__file__), "..", "assets", "tokenizer")
    LAYERS, VOCAB, SEQ = 4, 128, 16
    TINY = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=LAYERS,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5,
        rope_theta=10000.0, tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )
    # (P, scheme, layer kinds): stock Llama (Bridge's own Llama bridge), Mix-LN, all Post-LN, LNS,
    # Mix-LN + LNS; then the comparison arms' per-layer layouts (every kind in one model, and
    # sandwich layers under LNS).
    ARMS, LNS_SANDWICH = ["deepnorm", "sandwich", "post", "pre"], ["pre", "sandwich", "sandwich", "sandwich"]
    LAYOUTS = [(0, "mixln", None), (1, "mixln", None), (LAYERS, "mixln", None), (0, "lns", None),
               (2, "mixln+lns", None), (2, "mixln", ARMS), (0, "lns", LNS_SANDWICH)]
    IDS = [f"P{p}-{s}" + ("-" + "-".join(k) if k else "") for p, s, k in LAYOUTS]

    def layout_fields(kinds):
        """config_for_export's per-layer fields (DeepNorm's constants set when a layer is deepnorm)."""
        if kinds is None:
            return {}
        return {"layer_kinds": kinds, **({"deepnorm_alpha": 1.5, "deepnorm_beta": 0.4} if "deepnorm" in kinds else {})}

    def hf_model(post_ln, scheme, seed=0, kinds=None, tied=False):
        """The HF model of a layout, random weights (norm weights far from 1); tied: the output layer
        is the embedding (tie_word_embeddings)."""
        config = config_for_export(post_ln, scheme, None, **layout_fields(kinds), **{**TINY, "tie_word_embeddings": tied})
        torch.manual_seed(seed)
        cls = MixLNLlamaForCausalLM if config.model_type == "mixln_llama" else LlamaForCausalLM
        model = cls(config)
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in model.named_parameters():
                scale = torch.randn(p.shape, generator=g)
                p.copy_(1.0 + 0.5 * scale if "norm" in name else 0.08 * scale)
        return model.eval()

    def export_folder(model, path):
        """What `convert to-hf` writes: config (+ auto_map and code for Mix-LN), weights, tokenizer."""
        save_hf_folder(model, path)
        for name in os.listdir(TOKENIZER):
            shutil.copy(os.path.join(TOKENIZER, name), path)
        return path

    def tokens(seed=3):
        g = torch.Generator().manual_seed(seed)
        return torch.randint(0, VOCAB, (2, SEQ), generator=g)

    def megatron_logits(model, ids):
        pos = torch.arange(ids.shape[1]).unsqueeze(0).expand_as(ids)
        with torch.no_grad():
            return model(ids, pos, None)

    def bridge_models(folder, backend="local"):
        """AutoBridge -> provider -> the Megatron model chunks, HF weights loaded."""
        bridge = AutoBridge.from_hf_pretrained(folder, trust_remote_code=True)
        provider = bridge.to_megatron_provider(load_weights=True)
        if backend == "local":
            mixln_bridge.use_local_backend(provider, cpu=True)
        else:
            provider.use_cpu_initialization = True
            provider.gradient_accumulation_fusion = False
        provider.finalize()
        with cpu.te_modules() if backend == "te" else _nothing():
            models = provider.provide_distributed_model(
                wrap_with_ddp=False, use_cpu_initialization=True, mixed_precision_wrapper=None)
        return bridge, provider, models

    class _nothing:
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    def our_model(post_ln, scheme, kinds=None, tied=False):
        """The GPTModel this package builds itself (mixln_megatron.model.specs), same shape."""
        from mixln_megatron.model.layout import layout_text
        from mixln_megatron.model.settings import MixLNSettings
        from mixln_megatron.model.specs import get_mixln_decoder_block_spec

        cfg = testing.tiny_config(num_layers=LAYERS, hidden=64, heads=4, query_groups=2, ffn_hidden_size=96,
                                  layernorm_epsilon=1e-5)
        deepnorm = {k: v for k, v in layout_fields(kinds).items() if k.startswith("deepnorm")}
        settings = (MixLNSettings(layout=layout_text(kinds), scheme=scheme, **deepnorm)
                    if kinds else MixLNSettings(post_ln_layers=post_ln, scheme=scheme))
        spec = get_mixln_decoder_block_spec(cfg, backend="local", settings=settings)
        return testing.build_gpt(cfg, spec, vocab=VOCAB, untie=not tied, seq=64)

    @pytest.fixture(scope="module")
    def gloo():
        testing.init_distributed()
        yield
        testing.shutdown()
        cpu.disable()

    def hf_state(model, stored=False):
        """The HF model's tensors; stored: those its folder holds (a tied lm_head is not stored)."""
        tied = stored and model.config.tie_word_embeddings
        return {k: v for k, v in model.state_dict().items()
                if not k.endswith("inv_freq") and not (tied and k == "lm_head.weight")}

    # Every layout untied and tied: Bridge's tied path once lost the sandwich output norms (their
    # names contain "output_layer").
    TIES = [False, True]

    @pytest.mark.parametrize("tied", TIES, ids=["untied", "tied"])
    @pytest.mark.parametrize("post_ln,scheme,kinds", LAYOUTS, ids=IDS)
    def test_round_trip_local_backend(gloo, tmp_path, post_ln, scheme, kinds, tied):
        from mixln_megatron.model.layout import layout_text

        hf = hf_model(post_ln, scheme, kinds=kinds, tied=tied)
        folder = export_folder(hf, str(tmp_path / "exported"))
        assert ("lm_head.weight" in folder_tensors(folder)) is not tied
        bridge, provider, models = bridge_models(folder)
        assert provider.share_embeddings_and_output_weights is tied

        # The bridge: ours for Mix-LN folders (layout from the config), Bridge's Llama for P = 0.
        stock = post_ln == 0 and scheme == "mixln" and kinds is None
        bridge_name = type(bridge._model_bridge).__name__
        assert bridge_name == ("LlamaBridge" if stock else "MixLNLlamaBridge")
        if not stock:
            assert isinstance(provider, mixln_bridge.MixLNModelProvider)
            assert (provider.post_ln_layers, provider.mixln_scheme) == (post_ln, scheme)
            assert provider.mixln_layout == (layout_text(kinds) if kinds else None)
        (model,) = models
        layers = model.decoder.layers
        expected_kinds = kinds or ["post"] * post_ln + ["pre"] * (LAYERS - post_ln)
        assert [layer.kind for layer in layers] == expected_kinds
        if kinds and "deepnorm" in kinds:
            assert layers[kinds.index("deepnorm")].placement.deepnorm_alpha == 1.5

        # Logits equal HF's (fp32; different kernels, so to rounding).
        ids = tokens()
        with torch.no_grad():
            reference = hf(ids).logits
        torch.testing.assert_close(megatron_logits(model, ids), reference, rtol=0, atol=2e-5)

        # The model Bridge builds has the keys of the model this package builds.
        ours = our_model(post_ln, scheme, kinds, tied)
        assert set(model.state_dict()) == set(ours.state_dict())
        assert set(model.sharded_state_dict()) == set(ours.sharded_state_dict())

        # HF weights exported back exactly (those the folder holds).
        exported = dict(bridge.export_hf_weights(models, cpu=True, show_progress=False))
        expected = hf_state(hf, stored=True)
        assert set(exported) == set(expected)
        for name, tensor in expected.items():
            assert torch.equal(exported[name], tensor), name
        expected = hf_state(hf)

        # save_hf_pretrained -> the same folder kind, reloading to the same model.
        out = str(tmp_path / "saved")
        bridge.save_hf_pretrained(models, out, show_progress=False)
        reloaded = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True).eval()
        assert type(reloaded).__name__ == type(hf).__name__
        assert reloaded.config.tie_word_embeddings is tied
        if not stock:
            assert (reloaded.config.post_ln_layers, reloaded.config.mixln_scheme) == (post_ln, scheme)
            assert getattr(reloaded.config, "layer_kinds", None) == kinds
            if kinds and "deepnorm" in kinds:
                assert (reloaded.config.deepnorm_alpha, reloaded.config.deepnorm_beta) == (1.5, 0.4)
            assert reloaded.config.auto_map["AutoModelForCausalLM"].endswith(mixln_bridge.MIXLN_ARCHITECTURE)
            for name in ("configuration_mixln_llama.py", "modeling_mixln_llama.py"):
                assert os.path.isfile(os.path.join(out, name)), name
        got = hf_state(reloaded)
        assert set(got) == set(expected)
        for name, tensor in expected.items():
            assert torch.equal(got[name], tensor), name
        with torch.no_grad():
            assert torch.equal(reloaded(ids).logits, reference)

    def _without_tensor(folder, name):
        """The folder's weights less one tensor (a folder that does not hold what the config says)."""
        from safetensors.torch import save_file

        tensors = folder_tensors(folder)
        del tensors[name]
        for old in os.listdir(folder):
            if old.endswith(".safetensors") or old.endswith(".safetensors.index.json"):
                os.remove(os.path.join(folder, old))
        save_file(tensors, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})

    @pytest.mark.parametrize("tied", TIES, ids=["untied", "tied"])
    @pytest.mark.parametrize("lost", ["mapping", "tensor"])
    def test_a_parameter_the_load_would_not_write_is_refused(gloo, tmp_path, monkeypatch, lost, tied):
        """A Megatron parameter that no HF tensor is loaded into (its mapping removed from the
        registry, or its tensor from the folder) is a one-line ConversionError naming it, before
        any weight is copied, instead of a load that reports success and leaves it initialised."""
        from mixln_megatron.errors import ConversionError

        hf = hf_model(2, "mixln", kinds=ARMS, tied=tied)
        folder = export_folder(hf, str(tmp_path / "exported"))
        lost_name = "decoder.layers.1.mlp_output_layernorm.weight"  # the sandwich layer's N_d
        if lost == "mapping":
            real = mixln_bridge.MixLNLlamaBridge.mapping_registry

            def without_it(self):
                kept = [m for m in real(self).mappings if m.megatron_param != "decoder.layers.*.mlp_output_layernorm.weight"]
                assert len(kept) == len(real(self).mappings) - 1
                return type(real(self))(*kept)

            monkeypatch.setattr(mixln_bridge.MixLNLlamaBridge, "mapping_registry", without_it)
        else:
            _without_tensor(folder, "model.layers.1.post_feedforward_layernorm.weight")
        with pytest.raises(ConversionError) as err:
            bridge_models(folder)
        line = str(err.value)
        assert "\n" not in line and f"to 1 Megatron parameter(s) ({lost_name})" in line, line

    def test_megatron_to_hf_config_keeps_the_layout(gloo, tmp_path):
        """A config-only export (from a Megatron checkpoint) writes the Mix-LN fields and auto_map."""
        folder = export_folder(hf_model(2, "mixln+lns"), str(tmp_path / "exported"))
        bridge = AutoBridge.from_hf_pretrained(folder, trust_remote_code=True)
        provider = bridge.to_megatron_provider(load_weights=False)
        config = mixln_bridge.MixLNLlamaBridge.megatron_to_hf_config(provider)
        assert config["architectures"] == [mixln_bridge.MIXLN_ARCHITECTURE]
        assert (config["model_type"], config["post_ln_layers"], config["mixln_scheme"]) == (
            "mixln_llama", 2, "mixln+lns")
        assert config["auto_map"]["AutoModelForCausalLM"].endswith(mixln_bridge.MIXLN_ARCHITECTURE)
        assert config["num_hidden_layers"] == LAYERS

    @pytest.mark.parametrize("setting, named", [(dict(qk_layernorm=True), "[qk_layernorm=True]"),
                                                 (dict(window_size=(8, 0)), "[window_size=(8, 0)]")])
    def test_settings_the_export_refuses_are_refused_by_the_bridge_export_too(gloo, tmp_path, setting, named):
        """The export's refusals (model.config_fields) hold for the Bridge path: a provider with one
        is refused in one line by megatron_to_hf_config instead of written as plain Llama."""
        from mixln_megatron.bridge.llama import MixLNBridgeError

        folder = export_folder(hf_model(1, "mixln"), str(tmp_path / "exported"))
        provider = AutoBridge.from_hf_pretrained(folder, trust_remote_code=True).to_megatron_provider(
            load_weights=False)
        for name, value in setting.items():
            setattr(provider, name, value)
        with pytest.raises(MixLNBridgeError) as info:
            mixln_bridge.MixLNLlamaBridge.megatron_to_hf_config(provider)
        assert "\n" not in str(info.value) and named in str(info.value), str(info.value)

    # Megatron bias flags the dense Mix-LN Llama model cannot hold exactly: a q/k/v-only bias (LLaMA's
    # attention_bias is on o_proj too; the mixln_llama config has no qkv_bias), and biases on every
    # linear (no mapping carries them); each flag with the text its refusal names.
    DENSE_BIASES = {"qkv-bias": (dict(add_qkv_bias=True), "--add-qkv-bias"),
                    "bias-linear": (dict(add_bias_linear=True), "--disable-bias-linear"),
                    "both": (dict(add_qkv_bias=True, add_bias_linear=True), "--disable-bias-linear")}

    @pytest.mark.parametrize("bias", list(DENSE_BIASES))
    def test_dense_biases_the_hf_model_cannot_hold_are_refused_in_one_line(gloo, tmp_path, bias):
        """A dense Mix-LN provider (and so a model built from it) with add_qkv_bias or add_bias_linear
        is refused, one line naming the flag, by megatron_to_hf_config, save_hf_pretrained (no weights
        written) and save_megatron_checkpoint (nothing written), instead of exporting Bridge's
        attention_bias / mlp_bias (LLaMA's o_proj bias included, whose tensor the folder would lack)."""
        from mixln_megatron.bridge.llama import MixLNBridgeError

        setting, flag = DENSE_BIASES[bias]
        folder = export_folder(hf_model(1, "mixln"), str(tmp_path / "exported"))
        bridge = AutoBridge.from_hf_pretrained(folder, trust_remote_code=True)
        provider = bridge.to_megatron_provider(load_weights=False)
        assert mixln_bridge.MixLNLlamaBridge.megatron_to_hf_config(provider)["attention_bias"] is False
        for name, value in setting.items():
            setattr(provider, name, value)
        mixln_bridge.use_local_backend(provider, cpu=True)
        provider.finalize()
        models = provider.provide_distributed_model(wrap_with_ddp=False, use_cpu_initialization=True,
                                                    mixed_precision_wrapper=None)
        assert models[0].decoder.layers[0].self_attention.linear_qkv.bias is not None  # the model has them
        out, ckpt = tmp_path / "back", tmp_path / "ckpt"
        for export in (lambda: mixln_bridge.MixLNLlamaBridge.megatron_to_hf_config(provider),
                       lambda: bridge.save_hf_pretrained(models, str(out), show_progress=False),
                       lambda: mixln_bridge.save_megatron_checkpoint(models, str(ckpt))):
            with pytest.raises(MixLNBridgeError) as info:
                export()
            line = str(info.value)
            assert "\n" not in line and flag in line and line.split(" ")[0] in setting, line
        assert not list(out.glob("*.safetensors")) and not ckpt.exists()

    def test_an_invalid_layout_is_refused_in_one_line(gloo, tmp_path):
        """An HF config whose layer_kinds the model code would refuse is refused by the bridge too."""
        config = config_for_export(1, "mixln", None, layer_kinds=["deepnorm", "sandwich", "pre", "pre"],
                                   deepnorm_alpha=2.0, deepnorm_beta=0.5, **TINY)
        folder = export_folder(MixLNLlamaForCausalLM(config).eval(), str(tmp_path / "layout"))
        with open(os.path.join(folder, "config.json")) as f:
            text = f.read()
        with open(os.path.join(folder, "config.json"), "w") as f:
            f.write(text.replace('"sandwich"', '"sandwitch"'))
        with pytest.raises(ValueError, match="sandwitch") as err:
            bridge = AutoBridge.from_hf_pretrained(folder, trust_remote_code=True)
            bridge.to_megatron_provider(load_weights=False)
        assert "\n" not in str(err.value)

    def test_a_failed_save_leaves_nothing_and_nothing_is_overwritten(gloo, tmp_path, monkeypatch):
        """save_megatron_checkpoint writes a temporary folder and renames it in: a save that fails
        after its files are written leaves no checkpoint and no temporary; a non-empty folder is
        refused untouched; what a killed save left (its process gone) goes with the next save."""
        import json
        import signal
        import subprocess

        from megatron.core import dist_checkpointing

        from mixln_megatron.errors import ConversionError

        folder = export_folder(hf_model(1, "mixln"), str(tmp_path / "exported"))
        _, _, models = bridge_models(folder)
        real_save = dist_checkpointing.save

        def save_then_fail(*args, **kwargs):
            real_save(*args, **kwargs)
            raise OSError("no space left on device (injected)")

        monkeypatch.setattr(dist_checkpointing, "save", save_then_fail)
        with pytest.raises(OSError, match="injected"):
            mixln_bridge.save_megatron_checkpoint(models, str(tmp_path / "ckpt"))
        assert sorted(os.listdir(tmp_path)) == ["exported"]
        monkeypatch.setattr(dist_checkpointing, "save", real_save)

        mine = tmp_path / "mine"
        mine.mkdir()
        (mine / "notes.txt").write_text("keep")
        with pytest.raises(ConversionError, match="exists and is not an empty folder"):
            mixln_bridge.save_megatron_checkpoint(models, str(mine))
        assert os.listdir(mine) == ["notes.txt"] and (mine / "notes.txt").read_text() == "keep"

        gone = subprocess.Popen(["sleep", "600"])
        gone.send_signal(signal.SIGKILL)  # the save's process, killed outright (no cleanup ran)
        assert gone.wait() == -signal.SIGKILL
        stale = tmp_path / f".ckpt.tmp-{gone.pid}-0badc0de"
        (stale / "release").mkdir(parents=True)
        (stale / ".mixln-owner").write_text(json.dumps({"pid": gone.pid, "host": os.uname().nodename}))
        (tmp_path / "ckpt").mkdir()  # an empty folder is taken
        release = mixln_bridge.save_megatron_checkpoint(models, str(tmp_path / "ckpt"))
        assert release == str(tmp_path / "ckpt" / "release")
        assert sorted(os.listdir(tmp_path)) == ["ckpt", "exported", "mine"]
        assert sorted(os.listdir(tmp_path / "ckpt")) == ["latest_checkpointed_iteration.txt", "release"]
        assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text() == "release"
        assert os.path.isfile(tmp_path / "ckpt" / "release" / ".metadata")

    @pytest.mark.parametrize("post_ln,scheme,kinds,tied", [(1, "mixln", None, False), (0, "lns", None, False),
                                                           (2, "mixln", ARMS, False), (2, "mixln", ARMS, True)],
                             ids=["P1-mixln", "P0-lns", "arms", "arms-tied"])
    def test_te_backend_builds_loads_and_exports_exactly(gloo, tmp_path, post_ln, scheme, kinds, tied):
        reason = cpu.te_unavailable_reason()
        if reason:
            pytest.fail(reason) if REQUIRED else pytest.skip(reason)
        hf = hf_model(post_ln, scheme, kinds=kinds, tied=tied)
        for key, value in TOKENIZER_IDS.items():  # those of the tokenizer beside it, as convert to-hf writes
            setattr(hf.config, key, value)
        folder = export_folder(hf, str(tmp_path / "exported"))
        bridge, provider, models = bridge_models(folder, backend="te")
        assert provider.mixln_backend == "te"
        (model,) = models
        # TENorm is a factory: it builds TE's own RMSNorm.
        assert type(model.decoder.final_layernorm).__module__.startswith("transformer_engine")
        expected_kinds = kinds or ["post"] * post_ln + ["pre"] * (LAYERS - post_ln)
        for i, layer in enumerate(model.decoder.layers):
            assert layer.kind == expected_kinds[i]
            if layer.is_post_ln:
                assert type(layer.self_attention.linear_qkv).__name__ == "MixLNPostLNColumnParallelLinear"
        exported = dict(bridge.export_hf_weights(models, cpu=True, show_progress=False))
        expected = hf_state(hf, stored=True)
        assert set(exported) == set(expected)
        for name, tensor in expected.items():
            assert torch.equal(exported[name], tensor), name
        # The TE model's Megatron-LM checkpoint (TE's fused norm weights and extra state) converts
        # back to the source folder with our own tools.
        ckpt, back = str(tmp_path / "ckpt"), str(tmp_path / "back")
        mixln_bridge.save_megatron_checkpoint(models, ckpt, tokenizer_model=folder)
        _run(["-m", "mixln_megatron.cli", "convert", "to-hf", "--load", ckpt, "--save", back])
        assert_same_hf_folder(back, folder)

    # ------------------------------------------------------------------ TP2 and Megatron-LM checkpoints
    REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    PARALLEL_WORKER = os.path.join(REPO, "tests", "workers", "bridge_parallel_worker.py")
    sys.path.insert(0, os.path.dirname(PARALLEL_WORKER))
    from bridge_parallel_worker import folder_tensors  # noqa: E402  (every tensor of a folder's safetensors)
    # The special token ids of the tokenizer beside the folder (convert to-hf takes them from it).
    TOKENIZER_IDS = dict(bos_token_id=0, eos_token_id=0, pad_token_id=None)
    # Megatron-LM's tiny CPU run (as tests/test_vet_load.py): one iteration, lr 0 so that the saved
    # weights show what was loaded. The recorded tokenizer (4096 tokens) is larger than the tiny
    # model's 128-row vocabulary, so the run keeps its own NullTokenizer (127 + eod = 128).
    PRETRAIN_FLAGS = ["--no-use-tokenizer-model-from-checkpoint-args",
                      "--train-iters", "1", "--seq-length", "32", "--micro-batch-size", "2",
                      "--global-batch-size", "2", "--lr", "0.0", "--min-lr", "0.0", "--mock-data",
                      "--tokenizer-type", "NullTokenizer", "--vocab-size", "127", "--num-workers", "0",
                      "--eval-iters", "0", "--eval-interval", "1000", "--log-interval", "1",
                      "--use-cpu-initialization"]

    def _our_env():
        """Our own venv for our tools (the Bridge / TE overlays left off the path): the checkpoint is
        read by this package as installed, not by Bridge's environment."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("MIXLN_")}
        for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "BRIDGE_TESTS_REQUIRED"):
            env.pop(k, None)
        env.update(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", PYTHONPATH=REPO)
        return env

    def _run(cmd, timeout=600):
        import subprocess

        proc = subprocess.run([sys.executable, *cmd], capture_output=True, text=True, env=_our_env(),
                              timeout=timeout, cwd=REPO)
        assert proc.returncode == 0, f"{cmd} exit {proc.returncode}:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
        return proc

    def assert_same_hf_folder(got, expected):
        """Every weight bit for bit (names, dtypes, values), the same config once loaded, the same
        model code files and auto_map."""
        import json

        from transformers import AutoConfig

        a, b = folder_tensors(expected), folder_tensors(got)
        assert set(a) == set(b), sorted(set(a) ^ set(b))
        for name, tensor in a.items():
            assert b[name].dtype == tensor.dtype and torch.equal(b[name], tensor), name
        ca = AutoConfig.from_pretrained(expected, trust_remote_code=True).to_dict()
        cb = AutoConfig.from_pretrained(got, trust_remote_code=True).to_dict()
        diff = {k: (ca.get(k), cb.get(k)) for k in set(ca) | set(cb) if k != "_name_or_path" and ca.get(k) != cb.get(k)}
        assert not diff, diff
        ja, jb = (json.load(open(os.path.join(d, "config.json"))) for d in (expected, got))
        for key in ("architectures", "model_type", "auto_map", "post_ln_layers", "mixln_scheme", "mixln_alpha"):
            assert ja.get(key) == jb.get(key), (key, ja.get(key), jb.get(key))
        code = {n for n in os.listdir(expected) if n.endswith(".py")}
        assert code and code <= set(os.listdir(got)), (code, os.listdir(got))

    def _parallel_job(tmp_path, layouts, tp, pp, vpp=None, extra=()):
        """Exported folders (and reference logits) of the layouts, then one 2-process torchrun job of
        the parallel worker over them: (folders, rank 0's result by folder)."""
        folders = []
        for post_ln, scheme, *rest in layouts:
            kinds, tied = rest[0] if rest else None, len(rest) > 1 and rest[1]
            root = tmp_path / (f"P{post_ln}-{scheme}" + ("-layout" if kinds else "") + ("-tied" if tied else ""))
            hf = hf_model(post_ln, scheme, kinds=kinds, tied=tied)
            for key, value in TOKENIZER_IDS.items():
                setattr(hf.config, key, value)
            folder = export_folder(hf, str(root / "exported"))
            ids = tokens()
            with torch.no_grad():
                torch.save({"ids": ids, "logits": hf(ids).logits}, str(root / "reference.pt"))
            folders.append(folder)
        virtual = ["--vpp", str(vpp)] if vpp else []
        result = testing.last_result(testing.torchrun(
            PARALLEL_WORKER, 2, "--tp", str(tp), "--pp", str(pp), *virtual, *extra, *folders, timeout=1200,
            env={"OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}))
        return folders, result

    # [rank][chunk][global layer numbers]: PP2 splits the 4 layers in halves; with 2 virtual stages
    # each rank holds two chunks of one layer, interleaved (megatron's layer offsets).
    PIPELINES = {"pp2": (None, [[[1, 2]], [[3, 4]]]), "pp2-vpp2": (2, [[[1], [3]], [[2], [4]]])}

    @pytest.mark.parametrize("pipeline", sorted(PIPELINES))
    def test_pipeline_places_post_ln_by_global_layer_number_and_saves_a_checkpoint(tmp_path, pipeline):
        """PP2 through Bridge (and PP2 with 2 virtual stages), Mix-LN + LNS with P = 3 of 4: global
        layer 3 is Post-LN on the second stage (PP2) or in the first rank's second chunk (VPP), layer
        4 Pre-LN scaled by 1/sqrt(4); and the arms' layout (deepnorm, sandwich, post, pre), whose
        per-layer mappings name global layers, untied and tied (the last stage's output layer is
        the first stage's embedding, copied by Bridge). The logits through megatron's pipeline schedule equal
        HF's, the export is exact, and the checkpoints convert back to the source folders bit for bit.
        A load missing the last stage's final-norm mapping is refused on both ranks."""
        vpp, numbers = PIPELINES[pipeline]
        final_norm = "decoder.final_layernorm.weight"  # on the last stage only
        folders, result = _parallel_job(tmp_path, [(3, "mixln+lns"), (2, "mixln", ARMS), (2, "mixln", ARMS, True)],
                                        tp=1, pp=2, vpp=vpp, extra=("--refuse-without", final_norm))
        # A mapping gone for a parameter of one stage: every rank refuses the load (the worker
        # fails otherwise), in one line naming it.
        refusal = result.pop("refusal")
        assert f"to 1 Megatron parameter(s) ({final_norm})" in refusal and "\n" not in refusal, refusal
        assert sorted(result) == ["P2-mixln-layout", "P2-mixln-layout-tied", "P3-mixln+lns"], result
        for name, r in result.items():
            assert r["max_logit_diff"] < 2e-5 and r["layer_numbers"] == numbers, (name, r)
        assert result["P3-mixln+lns"]["layout"] == [3, "mixln+lns"]
        for folder in folders:
            ckpt, back = (os.path.join(os.path.dirname(folder), name) for name in ("ckpt", "back"))
            _run(["-m", "mixln_megatron.cli", "convert", "to-hf", "--load", ckpt, "--save", back])
            assert_same_hf_folder(back, folder)

    def test_tp2_and_a_checkpoint_our_tools_read(tmp_path):
        """Two gloo processes: AutoBridge -> TP2 provider -> the Mix-LN model split over both ranks ->
        logits equal HF's, export_hf_weights exact (P = 1 and lns), then save_megatron_checkpoint.
        That TP2 checkpoint -> `mixln-megatron convert to-hf` (our venv) -> the source folder again,
        bit for bit; `mixln-megatron pretrain --cpu --load` (TP1: resharded) vets it, loads it and
        trains one iteration, and what it saves converts back to the same weights (lr 0)."""
        import time

        times = {}
        t = time.time()
        folders, result = _parallel_job(tmp_path, [(1, "mixln"), (0, "lns"), (0, "lns", LNS_SANDWICH, True)], tp=2, pp=1)
        times["tp2 job"] = round(time.time() - t, 1)
        assert sorted(result) == ["P0-lns", "P0-lns-layout-tied", "P1-mixln"], result
        for name, r in result.items():
            assert r["max_logit_diff"] < 2e-5 and r["qkv_rows_per_rank"] * 2 == 64 + 2 * 32, r

        for folder in folders:
            root = os.path.dirname(folder)
            ckpt, back = os.path.join(root, "ckpt"), os.path.join(root, "back")
            assert open(os.path.join(ckpt, "latest_checkpointed_iteration.txt")).read() == "release"
            t = time.time()
            _run(["-m", "mixln_megatron.cli", "convert", "to-hf", "--load", ckpt, "--save", back])
            times[f"to-hf {os.path.basename(root)}"] = round(time.time() - t, 1)
            assert_same_hf_folder(back, folder)

        # pretrain --load of the P = 1 checkpoint (saved at TP2, loaded at TP1), one iteration. It
        # vets the checkpoint first (the vetting, here in-process too: every pickle through the
        # allow-list), then Megatron-LM reads the args, the content metadata and the tensors.
        from mixln_megatron.convert.vet import vet_checkpoint

        root = os.path.dirname(folders[0])
        ckpt, trained = os.path.join(root, "ckpt"), os.path.join(root, "trained")
        report = vet_checkpoint(ckpt)
        assert report.pickles.get("byte items", 0) >= 2, report.line()  # common state + settings record
        t = time.time()
        proc = _run(["-m", "mixln_megatron.training.pretrain", "--cpu", "--load", ckpt, "--use-checkpoint-args",
                     "--mixln-post-ln-layers", "1", *PRETRAIN_FLAGS, "--save", trained, "--save-interval", "1"])
        times["pretrain"] = round(time.time() - t, 1)
        import re

        losses = re.findall(r"iteration\s+1/\s*1 \|.*?lm loss: ([0-9.E+-]+)", proc.stdout)
        assert len(losses) == 1 and 0 < float(losses[0]) < 20, proc.stdout[-3000:]
        assert open(os.path.join(trained, "latest_checkpointed_iteration.txt")).read().strip() == "1"
        # The run's args say vocab 127 and no tokenizer (its NullTokenizer): the true vocabulary and
        # the tokenizer (special token ids) are given, as after any NullTokenizer run.
        _run(["-m", "mixln_megatron.cli", "convert", "to-hf", "--load", trained, "--save", trained + "-hf",
              "--vocab-size", str(VOCAB), "--tokenizer-model", folders[0]])
        assert_same_hf_folder(trained + "-hf", folders[0])
        print("bridge tp2 + checkpoint timings (s):", times)

    # Mix-LN MoE (bridge.moe): a dense first layer, 4 experts top-2, a gated shared expert; Mix-LN's
    # first P Post-LN, and every kind in one model (renormalised top-k off: megatron's pre-softmax)
    MOE_LAYOUTS = [dict(post_ln_layers=1), dict(post_ln_layers=2, layer_kinds=ARMS, deepnorm_alpha=1.5,
                                                deepnorm_beta=0.4, norm_topk_prob=False)]

    @pytest.fixture
    def cpu_router(monkeypatch):
        """megatron's router takes TransformerEngine's GEMM whenever TE imports (Bridge imports it),
        which needs a GPU; on the CPU it runs megatron's own torch path, as without TE."""
        from megatron.core.transformer.moe import moe_utils

        monkeypatch.setattr(moe_utils, "te_general_gemm", None)

    def moe_hf_folder(path, **fields):
        """The tiny Mix-LN MoE model (a dense first layer, 4 experts top-2, a gated shared expert) with
        `fields` on its config, random weights (biases too, norm weights far from 1), exported to `path`."""
        from mixln_megatron.hf import MixLNMoeConfig, MixLNMoeForCausalLM

        config = MixLNMoeConfig(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                shared_expert_intermediate_size=32, shared_expert_gate=True, mlp_only_layers=[0],
                                **{**TINY, **fields})
        torch.manual_seed(0)
        hf = MixLNMoeForCausalLM(config)
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for name, p in hf.named_parameters():
                scale = torch.randn(p.shape, generator=g)
                p.copy_(1.0 + 0.5 * scale if "norm" in name else 0.08 * scale)
        hf.eval()
        for key, value in TOKENIZER_IDS.items():  # those of the tokenizer beside it, as convert to-hf writes
            setattr(hf.config, key, value)
        return hf, config, export_folder(hf, str(path))

    @pytest.mark.parametrize("fields", MOE_LAYOUTS, ids=["P1", "arms-presoftmax"])
    def test_moe_round_trip_local_backend(gloo, cpu_router, tmp_path, fields):
        """A mixln_moe folder -> AutoBridge -> the Megatron MoE GPTModel: HF's logits, the provider's
        routing, the HF tensors exported back bit for bit (per-expert names), the config's MoE fields
        back from the provider (megatron_to_hf_config)."""
        hf, config, folder = moe_hf_folder(tmp_path / "moe", **fields)
        bridge, provider, models = bridge_models(folder)
        assert provider.num_moe_experts == 4 and provider.moe_router_topk == 2
        assert provider.moe_layer_freq == [0, 1, 1, 1]
        assert provider.moe_router_pre_softmax == (not config.norm_topk_prob) and provider.moe_shared_expert_gate
        model = models[0].eval()
        assert type(model.decoder.layers[0].mlp).__name__ == "MLP"
        assert all(type(layer.mlp).__name__ == "MoELayer" for layer in model.decoder.layers[1:])
        ids = tokens()
        with torch.no_grad():
            diff = (megatron_logits(model, ids) - hf(input_ids=ids).logits).abs().max().item()
        assert diff < 2e-5, diff
        out = str(tmp_path / "back")
        bridge.save_hf_pretrained(models, out)
        assert_same_hf_folder(out, folder)
        exported = mixln_bridge.MixLNMoeBridge.megatron_to_hf_config(provider)
        assert exported["model_type"] == "mixln_moe" and exported["num_experts"] == 4
        assert exported["mlp_only_layers"] == [0] and exported["norm_topk_prob"] == config.norm_topk_prob
        assert exported["shared_expert_gate"] is True and exported["post_ln_layers"] == fields["post_ln_layers"]
        # its Megatron-LM checkpoint (MoE args written from the provider) converts back to the folder
        ckpt, again = str(tmp_path / "ckpt"), str(tmp_path / "again")
        mixln_bridge.save_megatron_checkpoint(models, ckpt, tokenizer_model=folder)
        _run(["-m", "mixln_megatron.cli", "convert", "to-hf", "--load", ckpt, "--save", again])
        assert_same_hf_folder(again, folder)

    # The fp32 router (HF router_dtype "float32" <-> --moe-router-dtype fp32) and the q/k/v-only bias
    # (HF qkv_bias <-> --add-qkv-bias), each on Mix-LN's first P and on every kind in one model.
    MOE_CARRIED = {"router-fp32": dict(router_dtype="float32"), "qkv-bias": dict(qkv_bias=True)}

    @pytest.mark.parametrize("layout", [0, 1], ids=["P1", "arms"])
    @pytest.mark.parametrize("carried", sorted(MOE_CARRIED))
    def test_moe_router_dtype_and_qkv_bias_are_carried(gloo, cpu_router, tmp_path, carried, layout):
        """A mixln_moe folder with router_dtype "float32" (once refused) or qkv_bias (once dropped:
        the provider had no q/k/v bias, so the logits were another model's) -> AutoBridge: the
        provider routes in fp32 / has add_qkv_bias, megatron's linear_qkv.bias holds HF's q/k/v
        biases, the logits equal HF's, the export gives the folder's tensors and config back
        (megatron_to_hf_config: router_dtype / qkv_bias, no LLaMA attention_bias), and so does its
        Megatron-LM checkpoint through `convert to-hf`."""
        fields = {**MOE_LAYOUTS[layout], **MOE_CARRIED[carried]}
        hf, config, folder = moe_hf_folder(tmp_path / "moe", **fields)
        on_disk = folder_tensors(folder)
        has_bias = carried == "qkv-bias"
        assert any(name.endswith("q_proj.bias") for name in on_disk) is has_bias
        bridge, provider, models = bridge_models(folder)
        assert provider.moe_router_dtype == ("fp32" if carried == "router-fp32" else None)
        assert provider.add_qkv_bias is has_bias and provider.add_bias_linear is False
        model = models[0].eval()
        for i, layer in enumerate(model.decoder.layers):
            assert layer.mlp.config.moe_router_dtype == provider.moe_router_dtype
            bias = layer.self_attention.linear_qkv.bias
            assert (bias is not None) is has_bias, i
            if has_bias:  # HF's q, k, v biases, interleaved per query group as megatron's qkv rows are
                attn = hf.model.layers[i].self_attn
                heads, groups, d = TINY["num_attention_heads"], TINY["num_key_value_heads"], 64 // 4
                q, k, v = (getattr(attn, n).bias.detach().view(-1, d) for n in ("q_proj", "k_proj", "v_proj"))
                per = heads // groups
                want = torch.cat([torch.cat([q[g * per:(g + 1) * per], k[g:g + 1], v[g:g + 1]])
                                  for g in range(groups)]).flatten()
                assert torch.equal(bias.detach(), want), i
                assert q.abs().max() > 0.01  # the biases are not zero: the logits below see them
        ids = tokens()
        with torch.no_grad():
            diff = (megatron_logits(model, ids) - hf(input_ids=ids).logits).abs().max().item()
        print(f"bridge MoE {carried} {('P1', 'arms')[layout]}: max |Megatron - HF| logit difference {diff:.3g}")
        assert diff < 2e-5, diff

        exported = dict(bridge.export_hf_weights(models, cpu=True, show_progress=False))
        assert set(exported) == set(on_disk), sorted(set(exported) ^ set(on_disk))[:6]
        for name, tensor in on_disk.items():
            assert torch.equal(exported[name], tensor), name
        out = str(tmp_path / "back")
        bridge.save_hf_pretrained(models, out)
        assert_same_hf_folder(out, folder)

        hf_config = mixln_bridge.MixLNMoeBridge.megatron_to_hf_config(provider)
        assert hf_config["model_type"] == "mixln_moe"
        assert hf_config.get("router_dtype") == fields.get("router_dtype")
        assert hf_config.get("qkv_bias", False) is has_bias
        assert hf_config["attention_bias"] is False and hf_config["mlp_bias"] is False
        # the provider's own config makes the same HF model (a qkv_bias model has the biases)
        from mixln_megatron.hf import MixLNMoeConfig

        again = MixLNMoeConfig(**{k: v for k, v in hf_config.items() if k not in ("architectures", "auto_map")})
        assert (again.router_dtype, again.qkv_bias, again.attention_bias) == (
            config.router_dtype, config.qkv_bias, False)
        # its Megatron-LM checkpoint (args written from the provider's config) converts back to the folder
        ckpt, via_ckpt = str(tmp_path / "ckpt"), str(tmp_path / "again")
        mixln_bridge.save_megatron_checkpoint(models, ckpt, tokenizer_model=folder)
        _run(["-m", "mixln_megatron.cli", "convert", "to-hf", "--load", ckpt, "--save", via_ckpt])
        assert_same_hf_folder(via_ckpt, folder)

    @pytest.mark.parametrize("grouped,qkv_bias", [(False, False), (True, False), (False, True)],
                             ids=["sequential", "grouped-gemm", "sequential-qkv-bias"])
    def test_moe_te_backend_builds_loads_and_exports_exactly(gloo, tmp_path, grouped, qkv_bias):
        """The TE backend's MoE layers (TE linears per expert, or TE's grouped GEMM: weight0..weightN-1)
        load from and export to the folder bit for bit (TE's forward needs a GPU); with qkv_bias the
        Post-LN layer's and the Pre-LN layers' (fused norm) linear_qkv carry the q/k/v biases."""
        reason = cpu.te_unavailable_reason()
        if reason:
            pytest.fail(reason) if REQUIRED else pytest.skip(reason)
        from mixln_megatron.hf import MixLNMoeConfig, MixLNMoeForCausalLM

        config = MixLNMoeConfig(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                shared_expert_intermediate_size=32, shared_expert_gate=True, mlp_only_layers=[0],
                                post_ln_layers=1, qkv_bias=qkv_bias, **TINY)
        torch.manual_seed(0)
        hf = MixLNMoeForCausalLM(config).eval()
        if qkv_bias:  # HF initialises biases to zero; distinct values show the rows land where they belong
            with torch.no_grad():
                for name, p in hf.named_parameters():
                    if name.endswith("_proj.bias"):
                        p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))))
        folder = export_folder(hf, str(tmp_path / "moe"))
        bridge = AutoBridge.from_hf_pretrained(folder, trust_remote_code=True)
        provider = bridge.to_megatron_provider(load_weights=True)
        provider.use_cpu_initialization, provider.gradient_accumulation_fusion = True, False
        provider.moe_grouped_gemm = grouped
        provider.finalize()
        with cpu.te_modules():
            models = provider.provide_distributed_model(
                wrap_with_ddp=False, use_cpu_initialization=True, mixed_precision_wrapper=None)
        experts = models[0].decoder.layers[1].mlp.experts
        assert type(experts).__name__ == ("TEGroupedMLP" if grouped else "SequentialMLP"), type(experts)
        for layer in models[0].decoder.layers:  # TE keeps an empty tensor where there is no bias
            bias = layer.self_attention.linear_qkv.bias
            assert (bias is not None and bias.numel() == 64 + 2 * 32) is qkv_bias, bias
        exported = dict(bridge.export_hf_weights(models, cpu=True, show_progress=False))
        on_disk = folder_tensors(folder)  # the per-expert names the folder holds (HF fuses them in memory)
        assert set(exported) == set(on_disk), sorted(set(exported) ^ set(on_disk))[:6]
        for name, tensor in on_disk.items():
            assert torch.equal(exported[name], tensor), name

    def test_moe_routing_the_config_cannot_describe_is_refused_in_one_line(gloo, tmp_path):
        """A provider whose routing hf_moe_fields would describe as megatron's default one (a
        scaling factor, sigmoid scores with expert bias, sinkhorn, fp64 routing, probabilities on
        the input) or with biases the Mix-LN MoE model lacks (add_bias_linear) is refused, naming
        the flag, by the config export and so by the checkpoint's args (model.moe_fields); a folder
        with LLaMA's attention_bias (o_proj's too, which no mapping carries) is refused when the
        provider is made."""
        import json

        from mixln_megatron.bridge.moe import MoEBridgeError
        from mixln_megatron.hf import MixLNMoeConfig, MixLNMoeForCausalLM

        config = MixLNMoeConfig(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                mlp_only_layers=[0], post_ln_layers=1, **TINY)
        torch.manual_seed(0)
        folder = export_folder(MixLNMoeForCausalLM(config).eval(), str(tmp_path / "moe"))
        provider = AutoBridge.from_hf_pretrained(folder, trust_remote_code=True).to_megatron_provider(
            load_weights=False)
        for setting, flag in [(dict(moe_router_topk_scaling_factor=2.0), "--moe-router-topk-scaling-factor"),
                              (dict(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True),
                               "--moe-router-score-function"),
                              (dict(moe_router_load_balancing_type="sinkhorn"), "--moe-router-load-balancing-type"),
                              (dict(moe_router_dtype="fp64"), "--moe-router-dtype"),
                              (dict(moe_apply_probs_on_input=True), "--moe-apply-probs-on-input"),
                              (dict(add_bias_linear=True), "--disable-bias-linear")]:
            saved = {name: getattr(provider, name) for name in setting}
            for name, value in setting.items():
                setattr(provider, name, value)
            with pytest.raises(MoEBridgeError) as info:
                mixln_bridge.MixLNMoeBridge.megatron_to_hf_config(provider)
            assert "\n" not in str(info.value) and flag in str(info.value), (setting, str(info.value))
            for name, value in saved.items():
                setattr(provider, name, value)
        assert mixln_bridge.MixLNMoeBridge.megatron_to_hf_config(provider)["num_experts"] == 4
        edited = json.loads(open(os.path.join(folder, "config.json")).read())
        edited["attention_bias"] = True
        with open(os.path.join(folder, "config.json"), "w") as f:
            json.dump(edited, f)
        with pytest.raises(MoEBridgeError, match="attention_bias") as info:
            AutoBridge.from_hf_pretrained(folder, trust_remote_code=True).to_megatron_provider(load_weights=False)
        assert "\n" not in str(info.value)
