"""Hypothesis profiles for the property tests (`tests/test_properties.py`).

Two profiles, chosen by the environment variable `VIDAX_HYPOTHESIS_PROFILE`:

- `ci` (the default): every property test runs its own modest, fixed number of
  examples (`examples(n)`), `derandomize=True` (the examples are a function of the
  test alone: the same on every run and every machine), no example database and
  no deadline (a new shape means a new XLA compilation, which takes a variable
  fraction of a second).
- `sweep`: a long local search, `VIDAX_HYPOTHESIS_EXAMPLES` examples per test
  (default 2000), random seeds, failures remembered in the local
  `.hypothesis/` database and replayed first on the next run:

      VIDAX_HYPOTHESIS_PROFILE=sweep python -m pytest -q tests/test_properties.py -x

Both print the `@reproduce_failure` blob of a failing example.
"""

import os

from hypothesis import HealthCheck, settings


PROFILE = os.environ.get("VIDAX_HYPOTHESIS_PROFILE", "ci")
SWEEP_EXAMPLES = int(os.environ.get("VIDAX_HYPOTHESIS_EXAMPLES", "2000"))

# Drawing inputs is cheap; running them (compiling each new shape) is not, and
# that is expected here rather than a sign of a slow strategy.
_QUIET = [HealthCheck.too_slow, HealthCheck.data_too_large]

settings.register_profile(
    "ci", derandomize=True, database=None, deadline=None, print_blob=True,
    suppress_health_check=_QUIET,
)
settings.register_profile(
    "sweep", max_examples=SWEEP_EXAMPLES, derandomize=False, deadline=None, print_blob=True,
    suppress_health_check=_QUIET,
)
if PROFILE not in ("ci", "sweep"):
    raise ValueError(
        f"VIDAX_HYPOTHESIS_PROFILE must be 'ci' or 'sweep'; received {PROFILE!r}."
    )
settings.load_profile(PROFILE)


def examples(ci: int) -> settings:
    """Settings for one property test: `ci` examples in the `ci` profile, the sweep's
    count in the `sweep` profile."""
    return settings(max_examples=ci if PROFILE == "ci" else SWEEP_EXAMPLES)
