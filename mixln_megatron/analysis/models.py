"""Models the analyses run on: fresh megatron-core GPTs, Megatron torch_dist checkpoints, HF folders.

Everything here runs in one process: on CPU inside the caller's mixln_megatron.dev.cpu.harness()
(the command line enters it) + a single-rank gloo group, which is enough for the model sizes the diagnostics are meant for. On a machine with
CUDA the megatron models are moved to the current GPU instead (that path is untested here).

Three ways in, one interface out (`LanguageModel`):
  build_megatron_gpt(shape, post_ln_layers=, scheme=, seed=)   a fresh GPTModel from our spec
  load_megatron_checkpoint(path)                                a torch_dist checkpoint saved by
        Megatron-LM (`--ckpt-format torch_dist`), read by convert's checkpoint reader (the one
        loader; every pickle through the allow-list) into a megatron-core GPTModel built from
        the model arguments stored in the checkpoint; Mix-LN settings as convert.inspect reads
        them (record, content metadata, saved --mixln-* arguments). No conversion to HF.
  load_hf_model(path)                                           a Hugging Face folder (stock LLaMA
        or our mixln_llama export): read and validated by convert's HFCheckpoint (confined to the
        folder, safetensors or allow-listed .bin), built from its checked config.

LanguageModel gives the analyses what they need and nothing else:
  token_losses(ids, labels) -> [b, s] per-token cross-entropy (nats)
  layer_states(ids)         -> L + 1 tensors [b, s, h]: the input of every decoder layer, then the
                               output of the last layer (before the final norm)
  bypass(i)                 -> context manager in which decoder layer i (0-based) is the identity
  layers                    -> the decoder layers (for per-layer gradient norms)
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import List, Optional, Sequence

import torch
import torch.nn.functional as F

from ..model import support

# Embedding init std of the Mix-LN reference training code, as stated in the fidelity issue (megatron: 0.02).
REFERENCE_EMBEDDING_STD = math.sqrt(2.0 / 5.0)


# ----------------------------------------------------------------------------------- single process
def ensure_megatron_cpu(seed: int = 1234) -> None:
    """A one-rank gloo group and megatron's parallel state (TP = PP = 1), once.

    Without CUDA the caller must have entered the CPU harness (`with mixln_megatron.dev.cpu.
    harness(): ...`, as the analysis command line does): a library does not patch the process.
    Reuses a process group / parallel state that already exists (e.g. inside tests).
    """
    from megatron.core import parallel_state as ps

    from ..dev import cpu, testing

    if not torch.cuda.is_available() and not cpu.is_enabled():
        raise RuntimeError("megatron-core needs the CPU harness on a machine without CUDA: run this inside "
                           "`with mixln_megatron.dev.cpu.harness(): ...`")
    testing.init_process_group("gloo")
    if torch.distributed.get_world_size() != 1:
        raise RuntimeError("the analysis tools run in a single process (world size 1), not under torchrun")
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(1, 1)
    seed_everything(seed)


def seed_everything(seed: int) -> None:
    from megatron.core import tensor_parallel

    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


# ----------------------------------------------------------------------------------- model shapes
@dataclasses.dataclass(frozen=True)
class FreshShape:
    """The shape and initialisation of a fresh LLaMA-shaped GPT the analyses build (RMSNorm, SwiGLU,
    RoPE, no biases, untied embeddings, as the paper). A checkpoint's model shape is convert.shape's
    (ArgsShape / ModelShape, read by convert.inspect); this is only the recipe for a new model."""

    num_layers: int = 12
    hidden_size: int = 128
    num_attention_heads: int = 4
    ffn_hidden_size: Optional[int] = None  # default: LLaMA's 8/3 * hidden, rounded up to 16
    vocab_size: int = 4096
    seq_length: int = 128
    num_query_groups: Optional[int] = None
    init_method_std: float = 0.02  # megatron's default (also the std of the embeddings)
    embedding_init_std: Optional[float] = None  # None: init_method_std (megatron's default)
    untie_embeddings: bool = True

    @property
    def ffn(self) -> int:
        if self.ffn_hidden_size:
            return self.ffn_hidden_size
        return int(math.ceil(8 * self.hidden_size / 3 / 16) * 16)

    def describe(self) -> str:
        emb = self.embedding_init_std if self.embedding_init_std is not None else self.init_method_std
        return (f"L={self.num_layers} h={self.hidden_size} heads={self.num_attention_heads} "
                f"ffn={self.ffn} vocab={self.vocab_size} seq={self.seq_length} "
                f"init_std={self.init_method_std:g} emb_std={emb:.4g}")


def megatron_config(shape: FreshShape, **overrides):
    from megatron.core.transformer.transformer_config import TransformerConfig

    cfg = dict(
        num_layers=shape.num_layers, hidden_size=shape.hidden_size,
        num_attention_heads=shape.num_attention_heads, num_query_groups=shape.num_query_groups,
        ffn_hidden_size=shape.ffn, normalization="RMSNorm", layernorm_epsilon=1e-5,
        gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
        init_method_std=shape.init_method_std, embedding_init_method_std=shape.embedding_init_std,
        use_cpu_initialization=True, params_dtype=torch.float32, pipeline_dtype=torch.float32,
        attention_dropout=0.0, hidden_dropout=0.0, bias_dropout_fusion=False,
        apply_rope_fusion=False, gradient_accumulation_fusion=False, persist_layer_norm=False,
        masked_softmax_fusion=False, bias_activation_fusion=False,
    )
    cfg.update(overrides)
    return TransformerConfig(**cfg)


@contextlib.contextmanager
def _quiet_gpt_deprecation():
    """megatron-core 0.19 logs a deprecation notice for every GPTModel built; noise in sweeps."""
    import logging

    logger = logging.getLogger("megatron.core.models.gpt.gpt_model")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def _to_device(model):
    """On a machine with CUDA (no CPU shim there) the model runs on the current GPU; else CPU."""
    if torch.cuda.is_available():
        return model.cuda(torch.cuda.current_device())
    return model


def build_megatron_gpt(
    shape: FreshShape,
    post_ln_layers: int = 0,
    scheme: str = "mixln",
    seed: int = 1234,
    config_overrides: Optional[dict] = None,
    settings=None,
):
    """A fresh megatron-core GPTModel over our spec (local backend) on CPU, seeded. `settings`
    (a MixLNSettings, e.g. with a per-layer layout) replaces post_ln_layers / scheme."""
    from megatron.core.models.gpt import GPTModel

    from ..spec import get_mixln_decoder_block_spec

    ensure_megatron_cpu(seed)
    seed_everything(seed)
    config = megatron_config(shape, **(config_overrides or {}))
    if settings is not None:
        spec = get_mixln_decoder_block_spec(config, backend="local", settings=settings)
    else:
        spec = get_mixln_decoder_block_spec(config, backend="local", post_ln_layers=post_ln_layers, scheme=scheme)
    with _quiet_gpt_deprecation():
        model = GPTModel(
            config=config, transformer_layer_spec=spec, vocab_size=shape.vocab_size,
            max_sequence_length=shape.seq_length, position_embedding_type="rope",
            share_embeddings_and_output_weights=not shape.untie_embeddings,
        )
    return MegatronLM(_to_device(model))


# ----------------------------------------------------------------------------------- interface
class LanguageModel:
    """What the analyses need from a causal LM (see the module docstring)."""

    module: torch.nn.Module
    kind: str = "?"

    @property
    def layers(self) -> Sequence[torch.nn.Module]:
        raise NotImplementedError

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def vocab_size(self) -> int:
        raise NotImplementedError

    def token_losses(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def layer_states(self, ids: torch.Tensor) -> List[torch.Tensor]:
        raise NotImplementedError

    def _identity_forward(self, layer):
        raise NotImplementedError

    @contextlib.contextmanager
    def bypass(self, index: int):
        """Decoder layer `index` (0-based) returns its input unchanged while inside the block."""
        layer = self.layers[index]
        had_own = "forward" in layer.__dict__
        saved = layer.__dict__.get("forward")
        layer.forward = self._identity_forward(layer)
        try:
            yield layer
        finally:
            if had_own:
                layer.forward = saved
            else:
                del layer.forward

    def describe(self) -> str:
        return f"{self.kind} model with {self.num_layers} layers"


def _causal_mask(s: int) -> torch.Tensor:
    return torch.triu(torch.ones(1, 1, s, s, dtype=torch.bool), 1)


class MegatronLM(LanguageModel):
    """A megatron-core GPTModel (TP = PP = 1, on CPU)."""

    kind = "megatron"

    def __init__(self, model, source: str = "fresh", placement=None):
        self.module = model
        self.source = source
        self.placement = placement or getattr(model.decoder.layers[0], "placement", None)

    @property
    def layers(self):
        return list(self.module.decoder.layers)

    @property
    def vocab_size(self) -> int:
        return int(self.module.vocab_size)

    @property
    def device(self) -> torch.device:
        return next(self.module.parameters()).device

    def _inputs(self, ids):
        b, s = ids.shape
        dev = self.device
        pos = torch.arange(s, device=dev).unsqueeze(0).expand(b, s)
        return ids.to(dev), pos, _causal_mask(s).to(dev)

    def token_losses(self, ids, labels):
        """Per-token cross-entropy from the logits with torch's fused kernel (same value as
        megatron's vocab-parallel cross-entropy at TP = 1, a few times cheaper on CPU)."""
        ids, pos, mask = self._inputs(ids)
        logits = self.module(ids, pos, mask).float()  # [b, s, V]
        labels = labels.to(logits.device)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                               reduction="none").view_as(labels)

    def layer_states(self, ids):
        states: List[torch.Tensor] = []
        handles = []

        def pre_hook(module, args, kwargs):
            x = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
            states.append(x.detach().transpose(0, 1).float().cpu())  # [s, b, h] -> [b, s, h]

        def last_hook(module, args, kwargs, output):
            out = output[0] if isinstance(output, tuple) else output
            states.append(out.detach().transpose(0, 1).float().cpu())

        layers = self.layers
        for layer in layers:
            handles.append(layer.register_forward_pre_hook(pre_hook, with_kwargs=True))
        handles.append(layers[-1].register_forward_hook(last_hook, with_kwargs=True))
        try:
            ids, pos, mask = self._inputs(ids)
            with torch.no_grad():
                self.module(ids, pos, mask)
        finally:
            for h in handles:
                h.remove()
        if len(states) != len(layers) + 1:
            raise RuntimeError(f"expected {len(layers) + 1} layer states, captured {len(states)}")
        return states

    def _identity_forward(self, layer):
        def forward(hidden_states=None, *args, context=None, **kwargs):
            return hidden_states, context
        return forward

    def describe(self) -> str:
        p = self.placement
        where = f" ({p.describe().replace('[mixln_megatron] ', '')})" if p is not None else ""
        return f"megatron-core GPTModel, {self.num_layers} layers, from {self.source}{where}"


class HFLM(LanguageModel):
    """A Hugging Face causal LM whose decoder layers are model.model.layers (LLaMA family)."""

    kind = "hf"

    def __init__(self, model, source: str = "memory"):
        self.module = model
        self.source = source

    @property
    def layers(self):
        return list(self.module.model.layers)

    @property
    def vocab_size(self) -> int:
        return int(self.module.config.vocab_size)

    def token_losses(self, ids, labels):
        logits = self.module(input_ids=ids, use_cache=False).logits.float()
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                               reduction="none").view_as(labels)

    def layer_states(self, ids):
        """hidden_states[0..L-1] of output_hidden_states (the layer inputs) and the last layer's output.

        The last entry of `hidden_states` is the final norm's output in transformers, so the last
        layer's raw output is taken with a forward hook instead.
        """
        last = []

        def hook(module, args, output):
            out = output[0] if isinstance(output, tuple) else output
            last.append(out.detach().float())

        handle = self.layers[-1].register_forward_hook(hook)
        try:
            with torch.no_grad():
                out = self.module(input_ids=ids, output_hidden_states=True, use_cache=False)
        finally:
            handle.remove()
        hs = out.hidden_states
        n = self.num_layers
        if hs is None or len(hs) != n + 1 or len(last) != 1:
            raise RuntimeError(f"expected {n + 1} hidden states from output_hidden_states, got "
                               f"{None if hs is None else len(hs)}")
        return [h.detach().float() for h in hs[:n]] + [last[0]]

    def _identity_forward(self, layer):
        def forward(hidden_states, *args, **kwargs):
            return hidden_states
        return forward

    def describe(self) -> str:
        cfg = self.module.config
        post = getattr(cfg, "post_ln_layers", 0)
        scheme = getattr(cfg, "mixln_scheme", "mixln")
        return (f"Hugging Face {type(self.module).__name__}, {self.num_layers} layers "
                f"(post_ln_layers={post}, scheme={scheme}), from {self.source}")


# ----------------------------------------------------------------------------------- loading
def _hf_classes(model_type: str):
    if model_type == "mixln_llama":
        from ..hf import MixLNLlamaConfig, MixLNLlamaForCausalLM

        return MixLNLlamaConfig, MixLNLlamaForCausalLM
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaConfig, LlamaForCausalLM


def check_hf_folder(path: str):
    """Validate an HF folder before anything reads it for the analyses: -> (HFCheckpoint, config,
    model class). One ConversionError (a MixLNError: one line, exit 2) for anything wrong.

    The folder is untrusted input (issue 27): it is read by convert's HFCheckpoint (every file
    confined to the folder; config.json, the index and every safetensors header validated; a .bin
    through the allow-listed unpickler), its config fields checked for type and range, the layers
    of the weight names against num_hidden_layers, and every tensor the model needs by name and
    shape against the headers (on a meta-device model: no memory), all before the model is built.
    """
    import os

    from ..convert.from_hf import check_layers_against_files
    from ..convert.hf_folder import HFCheckpoint
    from ..convert.shape import hf_config_shape

    hf = HFCheckpoint(path)
    refuse_moe_hf_folder(hf.path, hf.config)
    hf.check_listing()  # transformers' tokenizer loader may read any file of the folder later
    config_path = os.path.join(hf.path, "config.json")
    shape = hf_config_shape(hf.config, config_path, megatron=False)
    check_layers_against_files(hf, shape)
    config_class, model_class = _hf_classes(hf.config["model_type"])
    try:
        config = config_class.from_dict(dict(hf.config))
        with torch.device("meta"):  # names and shapes only: no memory
            expected = {k: tuple(v.shape) for k, v in model_class(config).state_dict().items()}
    except (ValueError, TypeError, KeyError, AttributeError, AssertionError, RuntimeError) as e:
        raise ConversionError(f"{config_path} does not describe a model transformers can build: {one_line(e)}") from None
    tied = {"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()
    problems = []
    for name, want in expected.items():
        if not hf.has(name):
            if name not in tied:
                problems.append(f"missing {name}")
        elif tuple(hf.shape(name)) != want:
            problems.append(f"{name} has shape {tuple(hf.shape(name))}, config.json implies {want}")
        if len(problems) > 8:
            break
    if problems:
        raise ConversionError(f"{hf.path} does not match its config.json: " + "; ".join(problems))
    return hf, config, model_class


def refuse_moe_hf_folder(path: str, config: dict) -> None:
    """The analyses read MoE models from Megatron checkpoints only: the HF loader here fills a
    LLaMA-family model tensor by tensor and knows no experts."""
    model_type = str(config.get("model_type", ""))
    if config.get("num_local_experts") or config.get("num_experts") or model_type.endswith("moe") \
            or model_type == "mixtral":
        raise ConversionError(
            f"{path} is an MoE Hugging Face model ({config.get('model_type')}): analyze reads MoE models from Megatron "
            "torch_dist checkpoints only; pass --load DIR (convert an HF folder with `mixln-megatron convert from-hf`)")


def load_hf_model(path: str) -> HFLM:
    """A Hugging Face folder: stock LLaMA, or our mixln_llama export (never remote code), validated
    by check_hf_folder. transformers never opens a weight file here: the model is built from the
    validated config and its parameters are filled from HFCheckpoint, tensor by tensor."""
    hf, config, model_class = check_hf_folder(path)
    model = model_class(config).to(torch.float32)
    with torch.no_grad():
        for name, param in model.state_dict().items():
            if hf.has(name):
                param.copy_(hf.get(name))
    model.eval()
    return HFLM(model, source=hf.path)


from ..errors import ConversionError, MixLNError, one_line  # noqa: E402  (cli.main prints it in one line, exit 2)


class CheckpointError(MixLNError, ValueError):
    """A checkpoint cannot be read by the analysis tools; the message says why."""


def inspect_for_analysis(path: str, iteration: Optional[int]):
    """The checkpoint's args, shape and Mix-LN record (convert.inspect, shared with the converter),
    refused in one line if the analysis loader cannot build its model."""
    from ..convert.inspect import inspect_checkpoint

    try:  # MoE layers are read (analysis.moe builds megatron's own); MLA / MTP stay refused
        info = inspect_checkpoint(path, iteration, moe=True)
    except ConversionError as e:
        raise CheckpointError(str(e)) from None
    if info.format != "torch_dist":
        raise CheckpointError(f"{info.path} is a {info.format} checkpoint; the analysis tools read "
                              "--ckpt-format torch_dist checkpoints only")
    support.check(info.args, support.ANALYSIS, error=CheckpointError)  # mixln_megatron.model.support.TABLE
    return info


def _config_from_shape(a, embedding_rows: Optional[int] = None, args=None):
    """The model to build (FreshShape) + TransformerConfig for CPU inference from convert's ArgsShape
    (and the saved `args` for the MoE settings, analysis.moe). The vocabulary is the args'
    padded_vocab_size, else the saved embedding's rows (args saved before Megatron-LM built its
    tokenizer have none)."""
    from .moe import moe_config_fields

    vocab = a.padded_vocab_size if a.padded_vocab_size is not None else embedding_rows
    if vocab is None:
        raise CheckpointError("the checkpoint's saved args have no padded_vocab_size")
    shape = FreshShape(
        num_layers=a.num_layers, hidden_size=a.hidden_size, num_attention_heads=a.num_attention_heads,
        ffn_hidden_size=a.ffn_hidden_size, vocab_size=vocab, seq_length=a.max_position_embeddings,
        num_query_groups=a.num_query_groups, untie_embeddings=a.untie_embeddings,
    )
    overrides = {"kv_channels": a.kv_channels}
    if a.qk_layernorm:
        overrides["qk_layernorm"] = True
    overrides.update(moe_config_fields(args))  # {} for a dense model
    # muP's flags and the GLU offset as saved: megatron's own __post_init__ derives what the model uses
    overrides.update(a.mup or {})
    if a.forward.glu_linear_offset:
        overrides["glu_linear_offset"] = a.forward.glu_linear_offset
    return shape, megatron_config(
        shape, normalization=a.normalization, layernorm_epsilon=a.norm_epsilon,
        gated_linear_unit=a.swiglu, activation_func=F.silu if a.swiglu else F.gelu,
        add_bias_linear=a.add_bias_linear, add_qkv_bias=a.add_qkv_bias,
        layernorm_zero_centered_gamma=a.zero_centered_gamma, rotary_interleaved=a.rotary_interleaved,
        **overrides,
    )


def _state_from_reader(model, reader, num_layers: int, record: dict) -> dict:
    """The model's state dict with every tensor read by convert's checkpoint reader (TP = PP = 1).

    Layer tensors are read by role (both norm layouts, TE or local names, see convert.mapping);
    a layer tensor without a role (e.g. qk-layernorm weights) is read from its stacked key. The
    Mix-LN record is the checkpoint's, so that the layers' own check refuses other settings.
    """
    from ..convert import mapping as M
    from ..model.checkpoint import RECORD_NAME

    state = model.state_dict()
    by_layer = {}
    for key, value in state.items():
        if key.endswith(RECORD_NAME):
            state[key] = record
            continue
        if key.endswith("_extra_state") or not torch.is_tensor(value):
            continue
        if key.startswith(M.TD_LAYER_PREFIX):
            index, _, name = key[len(M.TD_LAYER_PREFIX):].partition(".")
            by_layer.setdefault(int(index), []).append((key, name))
        elif key == M.TD_EMBEDDING:
            state[key] = reader.read_vocab_rows("embedding", 0, value.shape[0])
        elif key == M.TD_OUTPUT:
            state[key] = reader.read_vocab_rows("output", 0, value.shape[0])
        elif key == M.TD_FINAL_NORM:
            state[key] = reader.read_final_norm()
        else:
            raise CheckpointError(f"{reader.path}: the analysis loader does not know the model tensor {key}")
    for layer in range(num_layers):
        named = by_layer.get(layer, [])
        roles = {name: role for _, name in named if (role := _layer_role(name)) is not None}
        tensors = reader.read_layer(layer, sorted(set(roles.values())))
        for key, name in named:
            if name in roles:
                state[key] = tensors[roles[name]]
                continue
            state[key] = _read_unmapped(reader, layer, name)
    return state


def _layer_role(name: str) -> Optional[str]:
    """convert.mapping's role of a model layer tensor (layer-local name), dense or MoE; None for
    a tensor without one (e.g. qk-layernorm weights)."""
    from ..convert import mapping as M
    from .moe import local_expert

    if name in M.LEGACY_LAYER_NAMES:
        return M.LEGACY_LAYER_NAMES[name]
    expert = local_expert(name)
    if expert is not None:
        return M.expert_role(*expert)
    return {n: role for role, n in M.MOE_ROLE_NAMES.items() if role not in M.EXPERT_ROLES}.get(name)


def _read_unmapped(reader, layer: int, name: str):
    """A layer tensor without a role: its row of the key stacked over the layers, or the layer's
    own key (megatron saves mixed dense / MoE stacks one key per layer)."""
    from ..convert import mapping as M

    stacked = M.TD_LAYER_PREFIX + name
    own = f"{M.TD_LAYER_PREFIX}{layer}.{name}"
    if reader.has(stacked):
        shape = reader.global_shape(stacked)
        return reader.read(stacked, (layer,) + (0,) * (len(shape) - 1), (1,) + shape[1:])[0]
    if reader.has(own):
        return reader.read(own, (0,) * len(reader.global_shape(own)), reader.global_shape(own))
    raise CheckpointError(f"{reader.path}: parameters missing from the checkpoint: {stacked}")


def load_megatron_checkpoint(
    path: str,
    iteration: Optional[int] = None,
    post_ln_layers: Optional[int] = None,
    scheme: Optional[str] = None,
) -> MegatronLM:
    """A torch_dist checkpoint (Megatron-LM layout) in a megatron-core GPTModel on CPU.

    The model shape comes from the `args` Megatron-LM stores in the checkpoint; post_ln_layers /
    scheme override the Mix-LN settings found in it (convert.inspect cross-checks its sources).
    Only TP = PP = 1 in memory; the checkpoint may have been saved with any parallel layout.
    """
    from megatron.core.models.gpt import GPTModel

    from ..model.placement import resolve_placement
    from ..model.settings import MixLNSettings, layered
    from ..spec import get_mixln_decoder_block_spec
    from .moe import plain_glu_rows

    ensure_megatron_cpu()
    info = inspect_for_analysis(path, iteration)
    ckpt_dir, a = info.path, info.shape
    # The checkpoint's placement (every layer's kind, a per-layer layout included); the caller's
    # post_ln_layers / scheme override it, as a command line would.
    saved = MixLNSettings.from_checkpoint(info.record) or MixLNSettings(post_ln_layers=0)
    given = MixLNSettings(post_ln_layers=post_ln_layers, scheme=scheme,
                          sources={"post_ln_layers": "command line", "scheme": "command line"})
    mixln_settings = layered(given, saved)
    shape, config = _config_from_shape(a, getattr(info.reader, "padded_vocab_size", None), info.args)
    placement = dataclasses.replace(  # where the kinds came from, as inspect names it
        resolve_placement(config.num_layers, mixln_settings),
        source="command line" if post_ln_layers is not None else info.record_source)
    spec = get_mixln_decoder_block_spec(config, backend="local", settings=mixln_settings)
    with _quiet_gpt_deprecation():
        model = GPTModel(
            config=config, transformer_layer_spec=spec, vocab_size=shape.vocab_size,
            max_sequence_length=shape.seq_length,
            position_embedding_type=a.position_embedding_type, rotary_percent=a.rotary_percent,
            rotary_base=a.rotary_base, seq_len_interpolation_factor=a.rotary_seq_len_interpolation_factor,
            rope_scaling=a.use_rope_scaling, rope_scaling_factor=a.rope_scaling_factor,
            share_embeddings_and_output_weights=not shape.untie_embeddings,
        )
    try:
        info.reader.check_layer_kinds(placement.kinds)  # and the sandwich layers' rows of the stacked norms
        state = _state_from_reader(model, info.reader, config.num_layers, info.reader.settings_record or info.record)
        plain_glu_rows(state, info.args)  # TE grouped GEMM's interleaved fc1 rows, for sequential experts
        model.load_state_dict(state, strict=True)
    except (ConversionError, RuntimeError) as e:  # RuntimeError: the layers' Mix-LN settings check
        raise CheckpointError(f"{ckpt_dir}: {one_line(e)}") from None
    model = _to_device(model)
    model.eval()
    lm = MegatronLM(model, source=ckpt_dir, placement=placement)
    lm.saved_args = info.args
    return lm


def load_model(megatron: Optional[str] = None, hf: Optional[str] = None, **kwargs) -> LanguageModel:
    if (megatron is None) == (hf is None):
        raise ValueError("give exactly one of a Megatron checkpoint and a Hugging Face folder")
    if hf is not None:
        return load_hf_model(hf)
    return load_megatron_checkpoint(megatron, **kwargs)
