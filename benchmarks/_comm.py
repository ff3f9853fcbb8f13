"""The least bytes one device must communicate in sequence-parallel attention: what
`_hlo.collective_bytes` of a compiled program is compared with (`parallel.py`, and
`models.py`'s CogVideoX rows). The formulas are derived in `parallel.py`'s docstring.
"""


def ring_bytes(pass_: str, n: int, S: int, H_kv: int, D: int, b: int) -> float:
    """Ring attention over `n` devices, global length `S`, `b` bytes per value:
    forward, K and V, `n - 1` hops; `"fwd+bwd"`, 3x that: the forward ring, then K and
    V again and their float32 dK and dV in the backward ring."""
    kv = 2 * (n - 1) / n * S * H_kv * D * b
    return kv if pass_ == "fwd" else kv + kv + 2 * (n - 1) / n * S * H_kv * D * 4


def ulysses_bytes(pass_: str, n: int, L: int, H: int, H_kv: int, D: int, b: int) -> float:
    """Ulysses over `n` devices, `L` the local length, `H_kv` after repetition:
    forward, q, k, v in and out back; `"fwd+bwd"`, q, k, v and the cotangent in, dq,
    dk, dv back (a gradient-only program never sends `out` back)."""
    unit = (n - 1) / n * L * D * b
    if pass_ == "fwd":
        return unit * (H + 2 * H_kv + H)  # q, k, v in; out back
    return unit * (2 * H + 2 * H_kv + H + 2 * H_kv)  # q, k, v, dout in; dq, dk, dv back
