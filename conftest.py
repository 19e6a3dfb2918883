"""Settings every test session shares (pytest loads this root conftest for every test path).

hypothesis runs derandomized by default, so CI sees the same examples on every run and a
failure reproduces; ``HYPOTHESIS_PROFILE=fuzz`` (``nox -s fuzz``) draws fresh random examples.
"""

from __future__ import annotations

import os

try:
    from hypothesis import settings
except ImportError:  # sessions without hypothesis (architecture, lint)
    pass
else:
    settings.register_profile("ci", derandomize=True, database=None, print_blob=True)
    settings.register_profile("fuzz", derandomize=False, print_blob=True)
    settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
