"""The weight-conversion tasks of the Mix-LN bridge: Bridge's own, with two corrections.

- Tied embeddings. Megatron-Bridge 0.6.2 leaves the output layer out of its tasks when the
  embeddings are tied (its weight is the embedding's), by dropping every parameter name that
  *contains* "output_layer". A sandwich layer's `attn_output_layernorm` / `mlp_output_layernorm`
  contain that text, so Bridge built no task for them: a load left them at their initial 1.0 and
  reported every weight loaded, an export left them out. Here the tasks are built as for untied
  embeddings, and then only the output layer's own (`output_layer.*`, GPTModel's top-level
  module) are dropped.
- Coverage. Bridge logs a warning and goes on when a Megatron parameter has no mapping, or its
  mapped HF tensor is not in the folder, so the parameter keeps whatever it was initialised to.
  Here that is a ConversionError naming the parameters, raised on every rank (the ranks' findings
  are gathered first: none is left waiting in a collective) before any weight is copied.
"""

from __future__ import annotations

import contextlib
import itertools

import torch

from ..errors import ConversionError

OUTPUT_LAYER_PREFIX = "output_layer."
NAMES_SHOWN = 4  # unwritten parameters named in the error; the rest are counted


def is_output_layer(global_name: str) -> bool:
    """A parameter of GPTModel's output layer itself (not a layer's *output_layernorm)."""
    return global_name.startswith(OUTPUT_LAYER_PREFIX)


@contextlib.contextmanager
def _seen_as_untied(bridge) -> None:
    """Within the block, Bridge's task builders see untied embeddings (and so drop no names)."""
    bridge._share_embeddings_and_output_weights = lambda config: False  # the instance's, over the class's
    try:
        yield
    finally:
        del bridge._share_embeddings_and_output_weights


def build_tasks(bridge, build, hf_pretrained, megatron_model, *args, **kwargs) -> list:
    """The tasks `build` (a Bridge task builder, bound to `bridge`'s class) makes for the model,
    corrected as the module doc says: with tied embeddings no layer parameter is lost, and every
    parameter of this rank that needs a value from the folder has a task that writes it."""
    from megatron.bridge.models.conversion.utils import unwrap_model

    models = unwrap_model(megatron_model if isinstance(megatron_model, list) else [megatron_model])
    tied = bool(bridge._share_embeddings_and_output_weights(models[0].config))
    if not tied:
        tasks = build(hf_pretrained, megatron_model, *args, **kwargs)
    else:
        with _seen_as_untied(bridge):
            tasks = build(hf_pretrained, megatron_model, *args, **kwargs)
        # The same order on every rank (tasks pair ranks up in collectives), less the output layer.
        tasks = [t for t in tasks if t is None or not is_output_layer(t.global_param_name)]
    check_every_parameter_written(bridge, models, tasks, tied, _folder_name(hf_pretrained))
    return tasks


def _folder_name(hf_pretrained) -> str:
    return str(getattr(hf_pretrained, "model_name_or_path", None) or "the HF model")


def unwritten_parameters(bridge, models, tasks, tied: bool) -> list:
    """Global names of this rank's parameters (and persistent buffers) that no task writes:
    Bridge's own exclusions aside (TE's _extra_state, adapters) and, with tied embeddings, the
    output layer (Bridge copies the embedding into it after the load)."""
    from megatron.bridge.models.conversion.model_bridge import _megatron_local_name_to_global
    from megatron.bridge.models.conversion.utils import persistent_buffers

    written = {(t.vp_stage, t.param_name) for t in tasks if t is not None and t.megatron_module is not None}
    is_adapter = getattr(bridge, "_is_adapter_param_name", lambda name: False)
    missing = []
    for vp_stage, model in enumerate(models):
        for name, _ in itertools.chain(model.named_parameters(), persistent_buffers(model)):
            if "_extra_state" in name or is_adapter(name):
                continue
            local = bridge._unwrap_name(name)
            global_name = _megatron_local_name_to_global(models, model.config, local, vp_stage)
            if (tied and is_output_layer(global_name)) or (vp_stage, local) in written:
                continue
            missing.append(global_name)
    return missing


def check_every_parameter_written(bridge, models, tasks, tied: bool, folder: str) -> None:
    """ConversionError on every rank when any rank has a parameter that no task writes."""
    missing = unwritten_parameters(bridge, models, tasks, tied)
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        everyone = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(everyone, missing)
        missing = [name for names in everyone for name in names]
    missing = sorted(set(missing))
    if missing:
        shown = ", ".join(missing[:NAMES_SHOWN]) + (f" and {len(missing) - NAMES_SHOWN} more"
                                                    if len(missing) > NAMES_SHOWN else "")
        raise ConversionError(
            f"{type(bridge).__name__} maps no tensor of {folder} to {len(missing)} Megatron parameter(s) "
            f"({shown}): they would keep their initial values (no mapping for them, or the mapped HF tensor "
            "is not in the folder); nothing was converted")
