"""The `--mixln-*` flags for Megatron-LM's argument parser, and the settings they make.

Used by the project's entry point (`mixln-megatron pretrain`, as an `extra_args_provider`) and by
the patch in patches/ that adds the same flags to a Megatron-LM checkout; it stays at the package's
top level because patched checkouts import it by this name. The flag names are settings.FIELDS';
the settings themselves are MixLNSettings.from_args (sources: the flags' names). Nothing is
exported to the environment: the entry point passes the object to the spec it builds; on a
patched checkout the `--spec` functions read the flags from Megatron-LM's global args.
"""

from __future__ import annotations

import argparse
from typing import Optional

from .model.settings import FIELDS, SCHEMES, MixLNSettings, layered

# flag -> (argparse options, help); every flag defaults to None so that "not given" stays visible.
_HELP = {
    "--mixln-alpha": (dict(type=str),
                      "Fraction of layers that are Post-LN: P = floor(alpha * num_layers). The paper uses 0.25 up "
                      "to 1B and 0.0625 at 7B. Exclusive with --mixln-post-ln-layers."),
    "--mixln-post-ln-layers": (dict(type=int), "Number P of leading Post-LN layers (global numbering). "
                               "Exclusive with --mixln-alpha."),
    "--mixln-scheme": (dict(type=str, choices=SCHEMES),
                       "mixln (default), lns (LayerNorm Scaling: Pre-LN, norm outputs of layer l scaled by "
                       "1/sqrt(l)), or mixln+lns (LNS on the Pre-LN layers of a Mix-LN model)."),
    "--mixln-spike-scaler": (dict(action="store_true"),
                             "Scale gradient spikes on the Post/Pre boundary norm weights down to their momentum."),
    "--mixln-spike-threshold": (dict(type=float), "Spike when |g| > threshold * momentum (default 50)."),
    "--mixln-spike-beta": (dict(type=float), "EMA coefficient of the gradient-magnitude momentum."),
    "--mixln-spike-warmup-steps": (dict(type=int), "Steps of momentum warm-up before anything is scaled."),
    "--mixln-spike-targets": (dict(type=str), "boundary (default: last Post-LN and first Pre-LN layer's norms), "
                              "all, or a comma list of global layer numbers."),
    "--mixln-telemetry-interval": (dict(type=int),
                                   "Log per-layer gradient norms every N steps (0 = off, the default; see "
                                   "mixln_megatron.training.telemetry). Written to TensorBoard/W&B when "
                                   "configured and to <save>/mixln_telemetry.jsonl."),
    "--mixln-telemetry-path": (dict(type=str), "Write the telemetry JSONL here instead of <save>/mixln_telemetry.jsonl."),
}


def add_mixln_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the Mix-LN flags; usable as Megatron-LM's `extra_args_provider`."""
    group = parser.add_argument_group("Mix-LN", "Mix-LN / LayerNorm Scaling (mixln_megatron)")
    for _, flag, _, _ in FIELDS:
        kwargs, help_text = _HELP[flag]
        group.add_argument(flag, default=None, help=help_text, **kwargs)
    return parser


def has_mixln_args(args) -> bool:
    """Whether `args` came from a parser with the --mixln-* flags (entry point or patch 0001)."""
    return hasattr(args, "mixln_alpha")


settings_from_args = MixLNSettings.from_args
settings_from_checkpoint_args = MixLNSettings.from_checkpoint


def run_settings(args, checkpoint_args=None) -> MixLNSettings:
    """A run's settings: the --mixln-* flags, then the resumed checkpoint's args, then defaults."""
    return layered(MixLNSettings.from_args(args), MixLNSettings.from_checkpoint(checkpoint_args))


def backend_from_args(args) -> str:
    """'te' or 'local', from Megatron-LM's --transformer-impl."""
    return "te" if getattr(args, "transformer_impl", "transformer_engine") == "transformer_engine" else "local"


def apply_mixln_args(args) -> Optional[MixLNSettings]:
    """Check the parsed flags (patch 0001 calls this right after parsing); returns the settings."""
    return MixLNSettings.from_args(args)
