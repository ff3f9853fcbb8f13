"""`examples/train_wan.py`: a tiny Wan trained with flow matching on dp=2 x sp=2 x tp=2
with FSDP over dp and sp, sharded == 1 device, resumed bit-exactly from an orbax
checkpoint, and resumed in another configuration (FSDP off) with the same losses.

The example sets `XLA_FLAGS` for 8 simulated devices before it imports JAX, and this
test process has JAX initialized already (conftest), so it runs in a subprocess.
"""

import os
import subprocess
import sys

import pytest


SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                      "examples", "train_wan.py")
CHECKS = (
    "loss decreased (1 device)",
    "loss decreased (sharded)",
    "sharded == 1 device",
    "sharded step compiled once",
    "restored == saved",
    "resume bit-exact",
    "restored step not recompiled",
    "restored into other config",
)


def _run_example(args, checks) -> str:
    """Runs the example with `args`; asserts it exited 0 and each of `checks` passed;
    returns its stdout and stderr's tail, for further assertions' messages."""
    proc = subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True,
                          timeout=600)
    output = f"{proc.stdout}\n{proc.stderr[-4000:]}"
    assert proc.returncode == 0, f"exit status {proc.returncode}:\n{output}"
    lines = proc.stdout.splitlines()
    for name in checks:
        assert any(line.strip().startswith(f"check {name}") and " ok " in line
                   for line in lines), f"check {name!r} did not pass:\n{output}"
    return output


@pytest.mark.slow  # a training run in a subprocess: ~35 s
def test_train_wan_sharded_matches_and_resumes_bit_exactly(tmp_path):
    output = _run_example(["--dp", "2", "--sp", "2", "--tp", "2", "--steps", "3",
                           "--resume-steps", "1", "--checkpoint-dir", str(tmp_path)], CHECKS)
    assert "fsdp over dp x sp" in output, output
    assert "all checks passed" in output, output
    assert (tmp_path / "step_3").is_dir(), f"no checkpoint in {tmp_path}:\n{output}"


LORA_CHECKS = (
    "loss decreased (1 device)",
    "sharded == 1 device",
    "sharded step compiled once",
    "base weights unchanged",
    "optimizer state adapter-sized",
    "LoRA file reads back",
    "merged == adapters",
)


@pytest.mark.slow  # a training run in a subprocess: ~20 s
def test_train_wan_lora_trains_only_adapters_and_saves_them(tmp_path):
    output = _run_example(["--lora", "4", "--dp", "2", "--sp", "2", "--tp", "2", "--steps", "3",
                           "--checkpoint-dir", str(tmp_path)], LORA_CHECKS)
    assert (tmp_path / "lora" / "pytorch_lora_weights.safetensors").is_file(), output
