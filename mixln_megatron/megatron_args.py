"""The `--mixln-*` command-line flags for Megatron-LM's argument parser.

Used by the project's entry point (`mixln-megatron pretrain`, as an `extra_args_provider`) and by
the patch in patches/ that adds the same flags to a Megatron-LM checkout. After parsing,
`apply_mixln_args(args)` validates the values and hands them to the plugin through the same
MIXLN_* environment the spec reads, so a flag always wins over a variable inherited from the
launcher and every rank resolves the same settings.
"""

from __future__ import annotations

import argparse
import os
from typing import MutableMapping, Optional

from .placement import (
    ENV_ALPHA,
    ENV_POST_LN_LAYERS,
    ENV_SCHEME,
    SCHEMES,
    MixLNConfigError,
    MixLNSettings,
)

# Spike scaler (mixln_megatron.spike): environment names shared with the flags below.
ENV_SPIKE = "MIXLN_SPIKE_SCALER"
ENV_SPIKE_THRESHOLD = "MIXLN_SPIKE_THRESHOLD"
ENV_SPIKE_BETA = "MIXLN_SPIKE_BETA"
ENV_SPIKE_WARMUP = "MIXLN_SPIKE_WARMUP_STEPS"
ENV_SPIKE_TARGETS = "MIXLN_SPIKE_TARGETS"
ENV_TELEMETRY_INTERVAL = "MIXLN_TELEMETRY_INTERVAL"


def add_mixln_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the Mix-LN flags; usable as Megatron-LM's `extra_args_provider`."""
    group = parser.add_argument_group("Mix-LN", "Mix-LN / LayerNorm Scaling (mixln_megatron)")
    group.add_argument(
        "--mixln-alpha", type=str, default=None,
        help="Fraction of layers that are Post-LN: P = floor(alpha * num_layers). The paper uses "
        "0.25 up to 1B and 0.0625 at 7B. Exclusive with --mixln-post-ln-layers.",
    )
    group.add_argument(
        "--mixln-post-ln-layers", type=int, default=None,
        help="Number P of leading Post-LN layers (global numbering). Exclusive with --mixln-alpha.",
    )
    group.add_argument(
        "--mixln-scheme", type=str, default=None, choices=SCHEMES,
        help="mixln (default), lns (LayerNorm Scaling: Pre-LN, norm outputs of layer l scaled by "
        "1/sqrt(l)), or mixln+lns (LNS on the Pre-LN layers of a Mix-LN model).",
    )
    group.add_argument(
        "--mixln-spike-scaler", action="store_true", default=None,
        help="Scale gradient spikes on the Post/Pre boundary norm weights down to their momentum.",
    )
    group.add_argument("--mixln-spike-threshold", type=float, default=None,
                       help="Spike when |g| > threshold * momentum (default 50).")
    group.add_argument("--mixln-spike-beta", type=float, default=None,
                       help="EMA coefficient of the gradient-magnitude momentum.")
    group.add_argument("--mixln-spike-warmup-steps", type=int, default=None,
                       help="Steps of momentum warm-up before anything is scaled.")
    group.add_argument(
        "--mixln-spike-targets", type=str, default=None,
        help="boundary (default: last Post-LN and first Pre-LN layer's norms), all, or a comma "
        "list of global layer numbers.",
    )
    group.add_argument(
        "--mixln-telemetry-interval", type=int, default=None,
        help="Log per-layer gradient norms every N steps (0 = off, the default; see "
        "mixln_megatron.telemetry). Written to TensorBoard/W&B when configured and to "
        "<save>/mixln_telemetry.jsonl.",
    )
    return parser


def apply_mixln_args(args, environ: Optional[MutableMapping[str, str]] = None) -> MixLNSettings:
    """Validate the parsed flags and export them to the MIXLN_* environment. Returns the settings.

    Flags win over inherited variables: giving --mixln-alpha clears MIXLN_POST_LN_LAYERS and the
    other way round.
    """
    env = os.environ if environ is None else environ
    alpha = getattr(args, "mixln_alpha", None)
    post = getattr(args, "mixln_post_ln_layers", None)
    scheme = getattr(args, "mixln_scheme", None)
    if alpha is not None and post is not None:
        raise MixLNConfigError(
            f"--mixln-alpha {alpha} and --mixln-post-ln-layers {post} were both given; pass one"
        )
    settings = MixLNSettings(alpha=alpha, post_ln_layers=post, scheme=scheme)  # validates
    if alpha is not None:
        env[ENV_ALPHA] = str(alpha)
        env.pop(ENV_POST_LN_LAYERS, None)
    if post is not None:
        env[ENV_POST_LN_LAYERS] = str(post)
        env.pop(ENV_ALPHA, None)
    if scheme is not None:
        env[ENV_SCHEME] = scheme
    spike_flags = {
        ENV_SPIKE: getattr(args, "mixln_spike_scaler", None),
        ENV_SPIKE_THRESHOLD: getattr(args, "mixln_spike_threshold", None),
        ENV_SPIKE_BETA: getattr(args, "mixln_spike_beta", None),
        ENV_SPIKE_WARMUP: getattr(args, "mixln_spike_warmup_steps", None),
        ENV_SPIKE_TARGETS: getattr(args, "mixln_spike_targets", None),
        ENV_TELEMETRY_INTERVAL: getattr(args, "mixln_telemetry_interval", None),
    }
    for name, value in spike_flags.items():
        if value is not None:
            env[name] = "1" if value is True else str(value)
    return settings
