"""`python -m vidax_eqx.generate`: the `vidax-generate` command."""

import sys

from ._command import main

sys.exit(main())
