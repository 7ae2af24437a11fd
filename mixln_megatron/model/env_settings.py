"""Moved: model/settings.py reads MIXLN_* (MixLNSettings.from_environ). These names remain for
the modules not yet moved (analysis/textdata.py); remove this file with them."""

from .settings import analysis_cache_dir, cpu_requested, settings_from_environ, settings_variables_set  # noqa: F401
