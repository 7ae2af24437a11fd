"""The `--mixln-*` command-line flags for Megatron-LM's argument parser, and the settings they make.

Used by the project's entry point (`mixln-megatron pretrain`, as an `extra_args_provider`) and by
the patch in patches/ that adds the same flags to a Megatron-LM checkout. It stays at the package's
top level because patched checkouts import it by this name. `settings_from_args`
turns parsed flags into a MixLNSettings whose sources are the flags' names (`--mixln-alpha`);
nothing is exported to the environment. The entry point passes that object to the spec it
builds; on a patched checkout the `--spec` functions read the flags from Megatron-LM's global
args (see spec.settings_for_spec).
"""

from __future__ import annotations

import argparse
from typing import Optional

from .errors import MixLNConfigError
from .model.settings import CHECKPOINT, SCHEMES, MixLNSettings, SpikeSettings, TelemetrySettings

# settings field -> the flag that sets it (the name the build line and errors show)
PLACEMENT_FLAGS = {
    "alpha": "--mixln-alpha",
    "post_ln_layers": "--mixln-post-ln-layers",
    "scheme": "--mixln-scheme",
}
SPIKE_FLAGS = {
    "enabled": "--mixln-spike-scaler",
    "threshold": "--mixln-spike-threshold",
    "beta": "--mixln-spike-beta",
    "warmup_steps": "--mixln-spike-warmup-steps",
    "targets": "--mixln-spike-targets",
}
TELEMETRY_FLAGS = {"interval": "--mixln-telemetry-interval", "path": "--mixln-telemetry-path"}


def _dest(flag: str) -> str:
    return flag[2:].replace("-", "_")


# (flag, argparse options, help): every flag defaults to None so that "not given" stays visible.
_FLAGS = (
    ("--mixln-alpha", dict(type=str),
     "Fraction of layers that are Post-LN: P = floor(alpha * num_layers). The paper uses 0.25 up "
     "to 1B and 0.0625 at 7B. Exclusive with --mixln-post-ln-layers."),
    ("--mixln-post-ln-layers", dict(type=int),
     "Number P of leading Post-LN layers (global numbering). Exclusive with --mixln-alpha."),
    ("--mixln-scheme", dict(type=str, choices=SCHEMES),
     "mixln (default), lns (LayerNorm Scaling: Pre-LN, norm outputs of layer l scaled by "
     "1/sqrt(l)), or mixln+lns (LNS on the Pre-LN layers of a Mix-LN model)."),
    ("--mixln-spike-scaler", dict(action="store_true"),
     "Scale gradient spikes on the Post/Pre boundary norm weights down to their momentum."),
    ("--mixln-spike-threshold", dict(type=float), "Spike when |g| > threshold * momentum (default 50)."),
    ("--mixln-spike-beta", dict(type=float), "EMA coefficient of the gradient-magnitude momentum."),
    ("--mixln-spike-warmup-steps", dict(type=int), "Steps of momentum warm-up before anything is scaled."),
    ("--mixln-spike-targets", dict(type=str),
     "boundary (default: last Post-LN and first Pre-LN layer's norms), all, or a comma list of "
     "global layer numbers."),
    ("--mixln-telemetry-interval", dict(type=int),
     "Log per-layer gradient norms every N steps (0 = off, the default; see "
     "mixln_megatron.training.telemetry). Written to TensorBoard/W&B when configured and to "
     "<save>/mixln_telemetry.jsonl."),
    ("--mixln-telemetry-path", dict(type=str),
     "Write the telemetry JSONL here instead of <save>/mixln_telemetry.jsonl."),
)


def add_mixln_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the Mix-LN flags; usable as Megatron-LM's `extra_args_provider`."""
    group = parser.add_argument_group("Mix-LN", "Mix-LN / LayerNorm Scaling (mixln_megatron)")
    for flag, kwargs, help_text in _FLAGS:
        group.add_argument(flag, default=None, help=help_text, **kwargs)
    return parser


def has_mixln_args(args) -> bool:
    """Whether `args` came from a parser with the --mixln-* flags (entry point or patch 0001)."""
    return hasattr(args, "mixln_alpha")


def settings_from_args(args) -> MixLNSettings:
    """MixLNSettings from parsed --mixln-* flags; each value's source is its flag's name."""
    alpha = getattr(args, "mixln_alpha", None)
    post = getattr(args, "mixln_post_ln_layers", None)
    if alpha is not None and post is not None:
        raise MixLNConfigError(
            f"--mixln-alpha {alpha} and --mixln-post-ln-layers {post} were both given; pass one"
        )
    spike = {name: getattr(args, _dest(flag), None) for name, flag in SPIKE_FLAGS.items()}
    return MixLNSettings(
        **{name: getattr(args, _dest(flag), None) for name, flag in PLACEMENT_FLAGS.items()},
        spike=SpikeSettings(**spike, sources=SPIKE_FLAGS),
        telemetry=TelemetrySettings(
            **{name: getattr(args, _dest(flag), None) for name, flag in TELEMETRY_FLAGS.items()},
            sources=TELEMETRY_FLAGS,
        ),
        sources=PLACEMENT_FLAGS,
    )


def settings_from_checkpoint_args(checkpoint_args) -> Optional[MixLNSettings]:
    """The placement a checkpoint's saved args carry (from-hf writes mixln_post_ln_layers), or None."""
    if checkpoint_args is None:
        return None
    post = getattr(checkpoint_args, "mixln_post_ln_layers", None)
    alpha = None if post is not None else getattr(checkpoint_args, "mixln_alpha", None)
    scheme = getattr(checkpoint_args, "mixln_scheme", None)
    if post is None and alpha is None and scheme is None:
        return None
    return MixLNSettings(
        alpha=alpha, post_ln_layers=post, scheme=scheme,
        sources={"alpha": CHECKPOINT, "post_ln_layers": CHECKPOINT, "scheme": CHECKPOINT},
    )


def apply_mixln_args(args) -> MixLNSettings:
    """Check the parsed flags (patch 0001 calls this right after parsing). Returns the settings.

    Exports nothing: the settings reach the spec as an object (entry point) or through
    Megatron-LM's global args (patched checkout, spec.settings_for_spec).
    """
    return settings_from_args(args)
