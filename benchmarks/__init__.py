"""The benchmarks: scripts run as `python benchmarks/NAME.py` (and the chip-only ones as
`python benchmarks/tpu/NAME.py`), each importing its helpers (`_harness`, `_hlo`, ...)
from this folder.

A package only so that the test suite imports the helpers it shares with the benchmarks
as `from benchmarks import _hlo` (the repository root is on its path), without editing
`sys.path`; the helpers import nothing from here, so both ways load the same code.
"""
