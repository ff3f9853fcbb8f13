"""Wan's text (and image) cross-attention layer (`WanT2VCrossAttention`,
`WanI2VCrossAttention`), and the keys and values of its context, computed once."""

from typing import ClassVar, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, PRNGKeyArray

from .._shapes import checked
from .. import kernels
from .._checks import check_positive
from .sharding._call_checks import check_context, check_text
from ._checks import check_attention
from .sharding._config import ParallelConfig
from .sharding._fsdp import fsdp_gather
from . import _init as init
from ._layers import after_tp, linear, local_heads, qk_rms_norm, row_parallel, tp_input
from ._norm import RMSNorm
from ._padding import check_length
from .sharding._parallel_layer import AbstractParallelLayer, MegatronSplit


class ContextKV(NamedTuple):
    """The keys and values of a [`CrossAttention`][]'s context, for this device's heads
    `H` (`num_heads`, or `num_heads / tp` under tensor parallelism), as
    [`CrossAttention.project_context`][] returns them and `__call__(x, context_kv=...)`
    takes them:

    - `k`, `v`: `(S_ctx, H, head_dim)`, the text's (`k` after `norm_k`);
    - `k_img`, `v_img`: `(S_img, H, head_dim)` with the image branch, else `None`.
    """

    k: Array
    v: Array
    k_img: Array | None = None
    v_img: Array | None = None


class CrossAttention(AbstractParallelLayer):
    """Wan text cross-attention (`WanT2VCrossAttention` of Wan2.1's `wan/modules/model.py`).

    Queries from the video tokens `x`, keys and values from the text `context`:
    `q = norm_q(q(x))`, `k = norm_k(k(context))`, `v = v(context)`, softmax attention
    without RoPE, then `o`.

    **Text padding:** Wan pads the text to a fixed length with zero embeddings and
    attends to the padding (its model passes `context_lens=None`). That is the
    default here; `context_mask` hides padded text tokens instead.

    **Parallelism:** under sequence parallelism (any mode) each device attends its
    own chunk of queries to the whole, replicated `context` (in_spec `P()`): no
    sequence communication. Tensor parallelism splits the heads as in [`Attention`][].

    **Image branch** (Wan's I2V `WanI2VCrossAttention`, `image_context_dim` set): the
    same queries also attend to the image context through `k_img`, `v_img` and
    `norm_k_img` (diffusers' `add_k_proj`, `add_v_proj`, `norm_added_k`), and the two
    attention outputs are added before `o`.

    **Precomputed keys and values:** the text does not change across denoising steps,
    so its keys and values can be computed once: [`project_context`][] returns them
    (this device's heads), and `__call__(x, context_kv=...)` uses them instead of
    projecting `context`, with bit for bit the same result.

    **Fields:** `q` (`Linear(dim, dim)`), `k`, `v` (`Linear(context_dim, dim)`), `o`
    (`Linear(dim, dim)`), all with bias; `norm_q`, `norm_k` ([`RMSNorm`][]`(dim)` or
    `None`); `k_img`, `v_img` (`Linear(image_context_dim, dim)`), `norm_k_img`, or
    `None` without the image branch; `parallel` (a leaf, as in [`Attention`][]);
    static `dim`, `context_dim`, `image_context_dim`, `num_heads`, `head_dim`,
    `qk_norm`, `eps`, `implementation`.
    """

    q: eqx.nn.Linear
    k: eqx.nn.Linear
    v: eqx.nn.Linear
    o: eqx.nn.Linear
    norm_q: RMSNorm | None
    norm_k: RMSNorm | None
    k_img: eqx.nn.Linear | None
    v_img: eqx.nn.Linear | None
    norm_k_img: RMSNorm | None
    dim: int = eqx.field(static=True)
    context_dim: int = eqx.field(static=True)
    image_context_dim: int | None = eqx.field(static=True)
    num_heads: int = eqx.field(static=True)
    head_dim: int = eqx.field(static=True)
    qk_norm: str | None = eqx.field(static=True)
    eps: float = eqx.field(static=True)
    parallel: ParallelConfig
    implementation: str | kernels.AbstractImplementation = eqx.field(static=True)
    megatron: ClassVar[MegatronSplit] = MegatronSplit(
        column=("q", "k", "v", "k_img", "v_img"), row=("o",),
        sharded_norms=("norm_q", "norm_k", "norm_k_img"))

    def __init__(
        self,
        dim: int,
        num_heads: int,
        *,
        context_dim: int | None = None,
        image_context_dim: int | None = None,
        qk_norm: str | None = "rms",
        eps: float = 1e-6,
        parallel: ParallelConfig = ParallelConfig(),
        implementation: str | kernels.AbstractImplementation = "auto",
        dtype=jnp.float32,
        key: PRNGKeyArray,
    ):
        """**Arguments:**

        - `dim`, `num_heads`, `qk_norm`, `eps`, `parallel`, `implementation`, `dtype`:
            as in [`Attention`][].
        - `context_dim`: the width of the text context, default `dim` (Wan embeds the
            text to `dim` before its blocks).
        - `image_context_dim`: the width of the image context of Wan's I2V models (Wan
            embeds it to `dim`), or `None` (text-to-video: no image branch).
        - `key`: a PRNG key for the linear layers' initialization.
        """
        self.head_dim, eps = check_attention(
            "CrossAttention", dim, num_heads, eps=eps, parallel=parallel, qk_norm=qk_norm,
            qk_norms=("rms", None))
        context_dim = dim if context_dim is None else context_dim
        check_positive("CrossAttention", context_dim=context_dim)
        if image_context_dim is not None:
            check_positive("CrossAttention", image_context_dim=image_context_dim)
        kq, kk, kv, ko, kki, kvi = init.split(key, 6)
        self.q = init.linear(dim, dim, dtype=dtype, key=kq)
        self.k = init.linear(context_dim, dim, dtype=dtype, key=kk)
        self.v = init.linear(context_dim, dim, dtype=dtype, key=kv)
        self.o = init.linear(dim, dim, dtype=dtype, key=ko)
        norm = (lambda: RMSNorm(dim, eps, dtype=dtype)) if qk_norm == "rms" else (lambda: None)
        self.norm_q, self.norm_k = norm(), norm()
        if image_context_dim is None:
            self.k_img = self.v_img = self.norm_k_img = None
        else:
            self.k_img = init.linear(image_context_dim, dim, dtype=dtype, key=kki)
            self.v_img = init.linear(image_context_dim, dim, dtype=dtype, key=kvi)
            self.norm_k_img = norm()
        self.image_context_dim = image_context_dim
        self.dim, self.context_dim, self.num_heads = dim, context_dim, num_heads
        self.qk_norm, self.eps = qk_norm, eps
        self.parallel, self.implementation = parallel, implementation

    def project_context(
        self,
        context: Float[Array, "S_ctx {self.context_dim}"],
        *,
        context_image: Float[Array, "S_img {self.image_context_dim}"] | None = None,
        context_copies: bool = False,
    ) -> ContextKV:
        """The keys and values of the context, as `__call__` computes them: to compute
        once and pass as `__call__(..., context_kv=...)` while the context does not
        change (the text across denoising steps).

        **Arguments:**

        - `context`, `context_image`, `context_copies`: as for `__call__`.

        **Returns:**

        `(k, v, k_img, v_img)`: `k`, `v` of shape `(S_ctx, H, head_dim)` (`k` after
        `norm_k`), `k_img`, `v_img` `(S_img, H, head_dim)` with the image branch, else
        `None`. `H` is this device's number of heads: `num_heads`, or `num_heads / tp`
        under tensor parallelism (computed inside `shard_map` as `__call__` computes
        them, `norm_k`'s statistics summed over `tp_axis`).
        """
        with jax.named_scope("vidax_eqx.nn.CrossAttention.project_context"):
            self._check_image(context_image)
            if not context_copies:
                check_text("CrossAttention", self.parallel, context)
                if context_image is not None:
                    check_text("CrossAttention", self.parallel, context_image)
            self, (context, context_image) = fsdp_gather(self, (context, context_image))
            return self._context_kv(context, context_image, None)

    def _check_image(self, context_image) -> None:
        if (self.k_img is None) != (context_image is None):
            raise ValueError(
                "CrossAttention: `context_image` is required with the image branch "
                "(image_context_dim set) and refused without it; received image_context_dim="
                f"{self.image_context_dim}, context_image="
                f"{None if context_image is None else context_image.shape}."
            )

    def _context_kv(self, context, context_image, q):
        """`(k, v, k_img, v_img)` of this device's heads (weights already gathered).
        `q`: the queries `norm_k`'s collective waits for under TP, or `None` (the
        context itself: the same `+ 0` on the values, see `_order.after`)."""
        H = local_heads("CrossAttention", self, self.q)
        S_ctx = context.shape[0]
        wait = context if q is None else q
        context = tp_input(context, self.parallel.tp_axis)
        k = qk_rms_norm(self.norm_k, after_tp(linear(self.k, context), wait, self), self)
        k = k.reshape(S_ctx, H, self.head_dim)
        v = linear(self.v, context).reshape(S_ctx, H, self.head_dim)
        if context_image is None:
            return ContextKV(k, v)
        S_img = context_image.shape[0]
        context_image = tp_input(context_image, self.parallel.tp_axis)
        k_img = linear(self.k_img, context_image)
        k_img = qk_rms_norm(self.norm_k_img, after_tp(k_img, k, self), self)
        k_img = k_img.reshape(S_img, H, self.head_dim)
        v_img = linear(self.v_img, context_image).reshape(S_img, H, self.head_dim)
        return ContextKV(k, v, k_img, v_img)

    def _check_kv(self, context_kv, H: int) -> None:
        """Raises unless `context_kv` is `(k, v, k_img, v_img)` of this module's
        local heads, the image part present exactly with the image branch."""
        def shape(a):
            return None if a is None else tuple(getattr(a, "shape", ()))

        ok = isinstance(context_kv, tuple) and len(context_kv) == 4
        if ok:
            k, v, k_img, v_img = context_kv
            pairs = [(k, v)] + ([(k_img, v_img)] if self.k_img is not None else [])
            ok = (self.k_img is not None) or (k_img is None and v_img is None)
            for a, b in pairs:
                ok = ok and all(
                    eqx.is_array(t) and t.ndim == 3 and t.shape[1:] == (H, self.head_dim)
                    for t in (a, b)) and shape(a) == shape(b)
        if not ok:
            image = "" if self.k_img is None else " and (S_img, H, head_dim) image keys/values"
            received = (tuple(shape(a) for a in context_kv) if isinstance(context_kv, tuple)
                        else type(context_kv).__name__)
            raise ValueError(
                f"CrossAttention: `context_kv` must be (k, v, k_img, v_img) as project_context "
                f"returns them: (S_ctx, H, head_dim) text keys/values{image} with this "
                f"device's H={H} heads and head_dim={self.head_dim}"
                + ("" if self.k_img is not None else ", k_img = v_img = None (no image branch)")
                + f"; received {received}."
            )

    @checked
    def __call__(
        self,
        x: Float[Array, "S {self.dim}"],
        context: Float[Array, "S_ctx {self.context_dim}"] | None = None,
        *,
        context_mask: Bool[Array, " S_ctx"] | None = None,
        context_image: Float[Array, "S_img {self.image_context_dim}"] | None = None,
        context_copies: bool = False,
        context_kv: ContextKV | tuple | None = None,
        context_length: Array | int | None = None,
    ) -> Float[Array, "S {self.dim}"]:
        """**Arguments:**

        - `x`: the video tokens `(S, dim)` of one example (this device's chunk under
            sequence parallelism).
        - `context`: the text tokens `(S_ctx, context_dim)`, whole on every device;
            `None` with `context_kv`.
        - `context_mask`: optional bool `(S_ctx,)`, `True` for real text tokens.
            `None` (the reference's behaviour) attends to every text token. A query
            whose mask hides every token gets 0 before `o`.
        - `context_image`: the image tokens `(S_img, image_context_dim)` of the image
            branch, whole on every device; required with the branch, refused without
            (`None` with `context_kv`).
        - `context_copies`: `True` when `context` (and `context_image`) are this
            device's copies of text a model embedded on every device with its own
            (possibly FSDP-gathered) weights: equal in value, but typed as varying over
            the FSDP axes, so the check that the text is whole and the same on every
            device (which refuses a text sharded like `x`) is skipped; the model checks
            its raw text input instead.
        - `context_kv`: the precomputed keys and values `(k, v, k_img, v_img)` of
            [`project_context`][] (this device's heads), used instead of `context` and
            `context_image` (which must then be `None`): the same result, bit for bit,
            without projecting the context. `k`, `v` are not checked against a context.
        - `context_length`: key-only padding of the text: an int scalar (a 0-d integer
            array, one per example under `jax.vmap`, or a Python int), the number of
            real text tokens; the text tokens at index `>= context_length` are hidden
            from every query (the kernels' `kv_lengths`, which the fast kernels serve;
            nothing the padded rows hold reaches the output), and every query is still
            computed. Cross-attention queries are video tokens, so this is the text
            padding mask of a model that pads its prompt (`context_mask` with a prefix
            of `True`, as a length, without the mask's move to the portable kernels).
            It differs from `segment_ids` padding (-1) in the self-attention modules,
            where a padded token also sees nothing. Combines with `context_mask`; the
            image branch is not affected. `None`: every text token is a key.

        **Returns:**

        `(S, dim)`.
        """
        with jax.named_scope("vidax_eqx.nn.CrossAttention"):
            if context_kv is not None and (context is not None or context_image is not None):
                raise ValueError(
                    "CrossAttention: `context_kv` (precomputed keys and values) replaces "
                    "`context` and `context_image`; pass them as None with it. Received "
                    f"context={None if context is None else context.shape}, context_image="
                    f"{None if context_image is None else context_image.shape}."
                )
            if context_kv is None and context is None:
                raise ValueError(
                    "CrossAttention: one of `context` (the text tokens) and `context_kv` "
                    "(their precomputed keys and values) is required; received neither."
                )
            if context_kv is None:
                check_context("CrossAttention", self.parallel, x,
                              context=None if context_copies else context, sharded_x=False)
                if context_image is not None and not context_copies:
                    check_context("CrossAttention", self.parallel, x, context=context_image,
                                  sharded_x=False)
                self._check_image(context_image)
            else:
                check_context("CrossAttention", self.parallel, x, sharded_x=False)
            self, (x, context, context_image, context_kv) = fsdp_gather(
                self, (x, context, context_image, context_kv))
            H = local_heads("CrossAttention", self, self.q)
            S = x.shape[0]
            q = qk_rms_norm(self.norm_q, linear(self.q, x), self).reshape(S, H, self.head_dim)
            if context_kv is None:
                context_kv = self._context_kv(context, context_image, q)
            else:
                self._check_kv(context_kv, H)
            k, v, k_img, v_img = context_kv
            if context_mask is not None and context_mask.shape[0] != k.shape[0]:
                raise ValueError(
                    f"CrossAttention: `context_mask` has one entry per text token ({k.shape[0]}); "
                    f"received shape {context_mask.shape}."
                )
            mask = None if context_mask is None else context_mask[None, None, None, :]
            context_length = check_length("CrossAttention", "context_length", context_length,
                                          k.shape[0])
            out = kernels.attention(
                q[None], k[None], v[None], mask=mask, implementation=self.implementation,
                kv_lengths=None if context_length is None else context_length[None],
            )[0]
            if k_img is not None:
                out = out + kernels.attention(
                    q[None], k_img[None], v_img[None], implementation=self.implementation
                )[0]
            return row_parallel(self.o, out.reshape(S, H * self.head_dim), self.parallel.tp_axis)
