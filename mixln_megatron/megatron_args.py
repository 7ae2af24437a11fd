"""The `--mixln-*` flags for Megatron-LM's argument parser, and the settings they make.

Used by `mixln-megatron pretrain` (as an `extra_args_provider`) and by the patch in patches/
that adds the same flags to a Megatron-LM checkout, which imports it by this top-level name. The
flags (names, help) are settings.FIELDS'; nothing is exported to the environment.
"""

from __future__ import annotations

import argparse
from typing import Optional

from .model.settings import FIELDS, SCHEMES, MixLNSettings, layered

_OPTIONS = {str: dict(type=str), int: dict(type=int), float: dict(type=float), bool: dict(action="store_true")}


def add_mixln_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the Mix-LN flags; usable as Megatron-LM's `extra_args_provider`."""
    group = parser.add_argument_group("Mix-LN", "Mix-LN / LayerNorm Scaling (mixln_megatron)")
    for field, flag, _, kind, help_text in FIELDS:  # default None: "not given" stays visible
        options = dict(_OPTIONS[kind], choices=SCHEMES) if field == "scheme" else _OPTIONS[kind]
        group.add_argument(flag, default=None, help=help_text, **options)
    return parser


def has_mixln_args(args) -> bool:
    """Whether `args` came from a parser with the --mixln-* flags (entry point or patch 0001)."""
    return hasattr(args, "mixln_alpha")


def run_settings(args, checkpoint_args=None, record=None, metadata=None) -> MixLNSettings:
    """A run's settings: the --mixln-* flags, then the resumed checkpoint's (its saved args, settings
    record and content-metadata entry, cross-checked: MixLNSettings.from_checkpoint), then defaults."""
    return layered(MixLNSettings.from_args(args),
                   MixLNSettings.from_checkpoint(checkpoint_args, record=record, metadata=metadata))


def backend_from_args(args) -> str:
    """'te' or 'local', from Megatron-LM's --transformer-impl."""
    return "te" if getattr(args, "transformer_impl", "transformer_engine") == "transformer_engine" else "local"


def apply_mixln_args(args) -> Optional[MixLNSettings]:
    """Check the parsed flags (patch 0001 calls this right after parsing); returns the settings."""
    return MixLNSettings.from_args(args)
