"""Hypothesis runs the same examples on every run by default (profile "ci": derandomized),
so that the README's test command passes or fails the same way on every machine; the
profile "explore" (`TANGRAM_HYPOTHESIS=explore pytest ...`) draws new ones each run, which
is how the property tests look for new failures (docs/development.md)."""

from __future__ import annotations

import os

from hypothesis import settings

settings.register_profile("ci", derandomize=True)
settings.register_profile("explore", derandomize=False)
settings.load_profile(os.environ.get("TANGRAM_HYPOTHESIS", "ci"))
