"""Reading a Megatron torch_dist checkpoint (through convert's reader) or a Hugging Face folder
(through convert's HFCheckpoint) into an analysis.models.LanguageModel, all checked before a model
is built; a refusal is one line (CheckpointError or ConversionError, both MixLNErrors).

MoE checkpoints run megatron's own MoELayer in evaluation mode, every forward-changing routing
setting carried as saved or refused (model.moe_fields.TABLE; docs/conversion.md, "Routing: every
MoE setting"). The experts always run as local sequential experts with the allgather dispatcher,
the only ones that run in one CPU process; that changes no weight (megatron saves grouped-GEMM
and sequential experts under the same keys), except a GLU interleave, whose fc1 rows are put back
in plain order on load (plain_glu_rows). Input jitter is not carried: the analysis measures the
noise-free model.
"""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Optional

import torch
import torch.nn.functional as F

from ..convert import inspect as checkpoint_inspect
from ..convert.from_hf import check_layers_against_files
from ..convert.hf_folder import HFCheckpoint
from ..convert.mapping import split_glu_rows
from ..convert.shape import hf_config_shape
from ..errors import ConversionError, MixLNError, one_line
from ..model import moe_fields, support
from ..model.placement import resolve_placement
from ..model.settings import MixLNSettings, layered
from .models import HFLM, FreshShape, MegatronLM, _to_device, ensure_megatron_cpu, gpt_model, megatron_config


# ------------------------------------------------------------------ Hugging Face folders
def _hf_classes(model_type: str):
    if model_type == "mixln_llama":
        from ..hf import MixLNLlamaConfig, MixLNLlamaForCausalLM  # heavy: transformers

        return MixLNLlamaConfig, MixLNLlamaForCausalLM
    from transformers import LlamaConfig, LlamaForCausalLM  # heavy

    return LlamaConfig, LlamaForCausalLM


def check_hf_folder(path: str):
    """Validate an untrusted HF folder before anything reads it: -> (HFCheckpoint, config, model
    class), or one ConversionError. Beyond HFCheckpoint's own checks: the config's fields, the
    weight names' layers against num_hidden_layers, and every tensor the model needs by name and
    shape against the headers (on a meta-device model: no memory)."""
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


# ------------------------------------------------------------------ Megatron checkpoints
class CheckpointError(MixLNError, ValueError):
    """A checkpoint cannot be read by the analysis tools; the message says why."""


def inspect_for_analysis(path: str, iteration: Optional[int]):
    """The checkpoint's args, shape and Mix-LN record (convert.inspect, shared with the converter),
    refused in one line if the analysis loader cannot build its model."""
    try:  # MoE layers are read (the MoE part below builds megatron's own); MLA / MTP stay refused
        info = checkpoint_inspect.inspect_checkpoint(path, iteration, moe=True)
    except ConversionError as e:
        raise CheckpointError(str(e)) from None
    if info.format != "torch_dist":
        raise CheckpointError(f"{info.path} is a {info.format} checkpoint; the analysis tools read "
                              "--ckpt-format torch_dist checkpoints only")
    support.check(info.args, support.ANALYSIS, error=CheckpointError)  # mixln_megatron.model.support.TABLE
    return info


def _config_from_shape(a, embedding_rows: Optional[int] = None, args=None):
    """The model to build (FreshShape) + TransformerConfig for CPU inference from convert's ArgsShape
    (and the saved `args` for the MoE settings, moe_config_fields). The vocabulary is the args'
    padded_vocab_size, else the saved embedding's rows (args saved before Megatron-LM built its
    tokenizer have none)."""
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
    model = gpt_model(config, {"settings": mixln_settings}, shape,
                      position_embedding_type=a.position_embedding_type, rotary_percent=a.rotary_percent,
                      rotary_base=a.rotary_base, seq_len_interpolation_factor=a.rotary_seq_len_interpolation_factor,
                      rope_scaling=a.use_rope_scaling, rope_scaling_factor=a.rope_scaling_factor)
    try:
        info.reader.check_layer_kinds(placement.kinds)  # and the sandwich layers' rows of the stacked norms
        state = info.reader.read_model_state(model.state_dict(), config.num_layers,
                                             info.reader.settings_record or info.record)
        plain_glu_rows(state, info.args)  # TE grouped GEMM's interleaved fc1 rows, for sequential experts
        model.load_state_dict(state, strict=True)
    except (ConversionError, RuntimeError) as e:  # RuntimeError: the layers' Mix-LN settings check
        raise CheckpointError(f"{ckpt_dir}: {one_line(e)}") from None
    model = _to_device(model)
    model.eval()
    lm = MegatronLM(model, source=ckpt_dir, placement=placement)
    lm.saved_args = info.args
    return lm


# ------------------------------------------------------------------ MoE
class MoEAnalysisError(MixLNError, ValueError):
    """An MoE setting the analysis model cannot carry; the message names the flag."""


# All three derive from model.moe_fields.TABLE (the one list of megatron's MoE settings).
# TransformerConfig field <- Megatron-LM argument, for the settings megatron's own layer computes.
CARRIED = {row.name: row.dests[0] for row in moe_fields.TABLE if row.analysis == moe_fields.CARRY}
# How the experts run in one CPU process (the weights do not depend on it, see the docstring).
CPU_EXECUTION = {row.name: row.analysis[1] for row in moe_fields.TABLE if isinstance(row.analysis, tuple)}
# Forward-changing settings the CPU model does not build: refused in one line when on.
REFUSED = tuple(row for row in moe_fields.TABLE if row.analysis == "refuse")


def moe_config_fields(args) -> dict:
    """TransformerConfig keyword arguments for the MoE layers of a checkpoint's args ({} for a
    dense model); a setting that cannot be carried is refused in one line naming its flag.
    Load balancing is carried only where it routes (sinkhorn's evaluation routing, quantile
    balancing with the saved qb_beta); the loss types only train."""
    if not moe_fields.num_experts(args):
        return {}
    get = moe_fields.getter(args)
    for row in REFUSED:
        if moe_fields.row_changes(row, get):
            raise MoEAnalysisError(f"{row.where} [{row.label}={get(row.name)!r:.40}]: the analysis loader does not "
                                   "build it; analyze a checkpoint trained without it")
    # interleaved rows whose saved order depends on the (expert) tensor-parallel size
    problem = moe_fields.interleave_rank_problem(get)
    if problem:
        raise MoEAnalysisError(problem)
    fields = {field: getattr(args, arg) for field, arg in CARRIED.items() if getattr(args, arg, None) is not None}
    if moe_fields.balancing(get) == "plain":
        fields.pop("moe_router_load_balancing_type", None)
    fields.update(CPU_EXECUTION)
    return fields


# ------------------------------------------------------------------ GLU-interleaved fc1 rows
_LOCAL_FC1 = re.compile(r"\.mlp\.experts\.local_experts\.\d+\.linear_fc1\.weight$")
_SHARED_FC1 = ".mlp.shared_experts.linear_fc1.weight"


def plain_glu_rows(state: dict, args) -> None:
    """Reorder, in `state` (the CPU model's state dict as read), the fc1 rows of experts saved
    GLU-interleaved ([gate s; up s] repeated) into the plain [gate; up] the CPU model computes with."""
    get = moe_fields.getter(args)
    experts, shared = moe_fields.expert_glu_interleave(get), moe_fields.shared_glu_interleave(get)  # None: plain
    if experts is None and shared is None:
        return
    for key, value in state.items():
        size = experts if _LOCAL_FC1.search(key) else shared if key.endswith(_SHARED_FC1) else None
        if size is not None:
            state[key] = torch.cat(split_glu_rows(value, size))


def fresh_moe_fields(num_experts: int, topk: int, ffn_hidden_size: Optional[int] = None, layer_freq=1) -> dict:
    """TransformerConfig keyword arguments of a fresh MoE model (analyze grad-norms, the benchmark)."""
    fields = {"num_moe_experts": num_experts, "moe_router_topk": topk, "moe_layer_freq": layer_freq}
    if ffn_hidden_size:
        fields["moe_ffn_hidden_size"] = ffn_hidden_size
    fields.update(CPU_EXECUTION)
    return fields
