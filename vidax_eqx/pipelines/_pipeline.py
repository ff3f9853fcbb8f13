"""The video pipeline template: loading a diffusers folder and the one `__call__` (the
checks, the stages and their timer), with the hooks each model family fills in and its
call defaults as class data."""

import abc
import dataclasses
import functools
import numbers
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from .. import interop, models, sampling
from ..models import internal as models_internal
from ._common import (
    check_int, dtype_of, encode_prompts, given_embeddings, load_text_encoder, parallel_for,
)
from ._compile_cache import enable_compile_cache
from ._folder import PipelineFolder
from ._memory import (
    device_budget, host_budget, MemoryPlan, plan_memory, program_bytes, Residency, size_of,
)
from ._output import PipelineOutput, StageTimer


@dataclasses.dataclass(frozen=True)
class CallDefaults:
    """A family's call defaults (diffusers' pipeline defaults and the model's frame
    rate): what a call, and `vidax-generate`, use for an argument left out.

    **Fields:** `height`, `width`, `num_frames`, `num_inference_steps`,
    `guidance_scale`, `max_sequence_length` (the prompt's tokens), `fps` (frames per
    second of the written video).
    """

    height: int
    width: int
    num_frames: int
    num_inference_steps: int
    guidance_scale: float
    max_sequence_length: int
    fps: float


# The stream folded into a call's `seed` key for a stochastic scheduler's noise (the
# initial latents are drawn from the key itself; CogVideoX I2V's posterior sample from
# stream 1).
SCHEDULER_STREAM = 2


def _check_seed(owner: str, seed) -> int:
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
        raise ValueError(f"{owner}: `seed` must be an int; received {seed!r}.")
    return int(seed)


class AbstractVideoPipeline(abc.ABC):
    """A diffusers video pipeline folder run in JAX: tokenizer, T5-family text encoder,
    transformer, VAE and scheduler (and a family's extra components), every stage
    compiled and sharded over a mesh when one is given.

    The call is one template for every family: the checks, then the stages `"text"`
    (the prompts encoded, or embeddings given), `"image"` (image-to-video: the image's
    condition), `"denoise"` ([`vidax_eqx.sampling.sample`][]) and `"decode"` (the VAE),
    each timed; the latents stay on the device from the noise to the decode. A family is
    a subclass: its call defaults and folder classes as class data, and the hooks below
    (the latent layout and sizes, the image condition, the decode, its components'
    loading).

    **Attributes:** `tokenizer` ([`vidax_eqx.interop.TextTokenizer`][]),
    `text_encoder` ([`vidax_eqx.models.T5Encoder`][]), `transformer`, `vae`,
    `scheduler` (a scheduler of [`vidax_eqx.sampling`][]), `mesh`, `batch_axis`,
    `cfg_axis`, `memory_plan` (the [`MemoryPlan`][vidax_eqx.pipelines.MemoryPlan] the
    components are placed by, `None` without one) and `placement`.
    """

    defaults: ClassVar[CallDefaults]
    """The family's call defaults."""
    pipeline_classes: ClassVar[tuple[str, ...]]
    """The diffusers pipeline classes (`model_index.json`'s `_class_name`) it loads."""
    clean_prompts: ClassVar[bool]
    """Whether prompts go through diffusers' cleaning before the tokenizer (Wan)."""
    masked_text: ClassVar[bool]
    """Whether the text encoder takes the attention mask and each row is zero past its
    tokens (Wan), or sees the padding (CogVideoX)."""
    latent_layout: ClassVar[str]
    """The initial latents' layout, for messages (`"(B, z, F, h, w)"`)."""

    def __init__(self, *, tokenizer, text_encoder, transformer, vae, scheduler, mesh=None,
                 batch_axis=None, cfg_axis=None):
        """**Arguments:** the components (see the class's attributes); `tokenizer` and
        `text_encoder` may be `None` for calls with `prompt_embeds`.

        - `mesh`: run sharded: the transformer must have been placed on it (its
            `ParallelConfig`); the VAE splits frames over two of its axes.
        - `batch_axis`, `cfg_axis`: [`vidax_eqx.sampling.Placement`][]'s (default: `"dp"`
            and `"cfg"` when the mesh has them with more than one device).
        """
        self.tokenizer, self.text_encoder = tokenizer, text_encoder
        self.transformer, self.vae, self.scheduler = transformer, vae, scheduler
        self.mesh = mesh
        sizes = {} if mesh is None else dict(mesh.shape)
        self.batch_axis = batch_axis if batch_axis is not None else (
            "dp" if sizes.get("dp", 1) > 1 else None)
        self.cfg_axis = cfg_axis if cfg_axis is not None else (
            "cfg" if sizes.get("cfg", 1) > 1 else None)
        self.memory_plan = None
        self._residency = Residency(None, jax.devices()[0])

    components: ClassVar[tuple[str, ...]] = ("text_encoder", "transformer", "vae")
    """The components a memory plan places (a family adds its own: Wan's `image_encoder`)."""

    @property
    def placement(self) -> dict[str, str]:
        """Where each component lives: `"device"` (resident on the accelerator), `"host"`
        (host memory, moved in for its stage), `"cpu"` (computed on the host CPU) or
        `"streamed"` (the transformer's blocks from host memory, one at a time)."""
        if self.memory_plan is not None:
            return dict(self.memory_plan.placement)
        return {name: "device" for name in self.components if getattr(self, name, None) is not None}

    def plan_memory(self, offload: str = "auto", device_memory=None, *, height=None, width=None,
                    num_frames=None, host_memory=None) -> MemoryPlan:
        """The [`MemoryPlan`][vidax_eqx.pipelines.MemoryPlan] of this pipeline's components
        (real or abstract: nothing is run or moved) for calls of `height x width x
        num_frames` (default the family's call defaults) with guidance: each stage's
        working memory from the compiler's memory analysis of its program, when there is
        a budget (`device_memory`, or the accelerator's capacity; none on a CPU
        backend); what it keeps off the device must fit `host_memory` (default the
        machine's physical memory). Raises `ValueError` naming each component's bytes and
        the budgets when no plan of `offload` fits."""
        owner = type(self).__name__
        moves = offload in ("model", "cpu", "blocks")  # (any other: checked by plan_memory)
        if self.mesh is not None and (moves or device_memory is not None):
            raise NotImplementedError(
                f"{owner}: a memory plan places the components of a pipeline on one accelerator; "
                f"over a mesh the weights are sharded instead (offload={offload!r}, "
                f"device_memory={device_memory!r}).")
        budget = None if self.mesh is not None else device_budget(device_memory, jax.devices()[0])
        sizes = {name: size_of(c) for name in self.components
                 if (c := getattr(self, name, None)) is not None}
        d = self.call_defaults
        video = (height or d.height, width or d.width, num_frames or d.num_frames)
        working = {} if budget is None else self.stage_memory(*video)
        return plan_memory(sizes, working, budget=budget, offload=offload, owner=owner,
                           video=video if working else None, host_budget=host_budget(host_memory))

    def _plan_for_call(self, height: int, width: int, num_frames: int) -> None:
        """Before a call larger than the video the memory plan was measured for: the plan
        made again for the call's size (the stages' working memory grows with it), and
        the components moved where the new plan says. Raises `ValueError` before any
        stage runs when nothing fits."""
        plan = self.memory_plan
        if plan is None or plan.video is None or height * width * num_frames <= np.prod(plan.video):
            return
        self.apply_memory_plan(self.plan_memory(plan.offload, plan.budget, height=height,
                                                width=width, num_frames=num_frames,
                                                host_memory=plan.host_budget))

    def apply_memory_plan(self, plan: MemoryPlan) -> None:
        """Places every component as `plan` says (each array moved one at a time), and
        carries the plan out around each stage of every call."""
        old = self.placement
        self._residency = Residency(plan, jax.devices()[0])
        for name, place in plan.placement.items():
            if place != old.get(name, "device"):
                setattr(self, name, self._residency.place(name, getattr(self, name)))
        self.memory_plan = plan

    def stage_memory(self, height=None, width=None, num_frames=None) -> dict[str, int]:
        """Each stage's working memory in bytes (besides the weights) for one call of
        `height x width x num_frames` with guidance (two rows of text): the compiler's
        memory analysis of the text encoder's, one guided transformer step's and the VAE
        decode's programs (and the VAE encode's for an image-conditioned family),
        compiled for the default backend, nothing run."""
        d = self.call_defaults
        height, width = height or d.height, width or d.width
        num_frames = num_frames or d.num_frames
        grid = self.check_size(height, width, num_frames)
        working = {}
        if self.text_encoder is not None:
            ids = jax.ShapeDtypeStruct((2, d.max_sequence_length), jnp.int32)
            working["text"] = program_bytes(lambda e, i: e.encode(i, i), self.text_encoder, ids)
        model = self.transformer
        shape = self.latent_shape(2, grid)
        layout = model.capabilities.latents
        channel = 1 if layout == "CFHW" else 2
        x = jax.ShapeDtypeStruct(shape[:channel] + (model.in_channels,) + shape[channel + 1:],
                                 jnp.dtype(self.transformer_dtype))
        t = jax.ShapeDtypeStruct((2,), jnp.float32)
        c = jax.ShapeDtypeStruct((2, d.max_sequence_length, model.text_dim),
                                 jnp.dtype(self.transformer_dtype))
        kwargs = self.analysis_arguments(2)
        working["denoise"] = program_bytes(
            lambda m, x, t, c, kw: jax.vmap(lambda x, t, c, kw: m(x, t, c, **kw))(x, t, c, kw),
            model, x, t, c, kwargs)
        z = jax.ShapeDtypeStruct((self.vae.z_dim,) + tuple(grid), jnp.float32)
        working["decode"] = program_bytes(lambda v, z: v.decode(z), self.vae, z)
        if self.image_conditioned:
            video = jax.ShapeDtypeStruct((3, num_frames, height, width), jnp.float32)
            working["image"] = program_bytes(lambda v, x: v.encode(x).mean, self.vae, video)
        return working

    def analysis_arguments(self, batch: int) -> dict:
        """The model arguments of one guided step of `batch` rows for the memory analysis
        (abstract or real arrays): the family's
        [`model_arguments`][vidax_eqx.pipelines.AbstractVideoPipeline.model_arguments]
        with its default options; a family adds what its image stage gives (Wan's CLIP
        features)."""
        return self.model_arguments(batch, None)

    # -- loading ------------------------------------------------------------------------

    @classmethod
    def from_pretrained(cls, path, *, dtype=None, text_encoder_dtype=None,
                        vae_dtype=jnp.float32, mesh=None, parallel=None, scheduler=None,
                        revision: str | None = None, cache_dir=None,
                        compile_cache: bool = True, offload: str = "auto",
                        device_memory=None, plan_video=None, host_memory=None,
                        quantize: str | None = None):
        """A pipeline folder saved by diffusers (`save_pretrained`) of one of the
        family's `pipeline_classes`, or a Hub repository of one (only JSON, safetensors
        and tokenizer files are fetched).

        **Arguments:**

        - `path`: the folder or Hub repository id.
        - `dtype`: the transformer's parameters' dtype (default the checkpoint's); also
            the text (and image) encoders' unless `text_encoder_dtype` is given.
        - `text_encoder_dtype`: the encoders' dtype (default `dtype`, or float32).
        - `vae_dtype`: the VAE's (default float32, as diffusers' examples load it).
        - `mesh`: a mesh with the library's axis names (`dp`, `sp`, `tp`, `cfg`:
            [`vidax_eqx.parallel.make_mesh`][]): the transformer loads straight into its
            sharded layout (`parallel`, default Ulysses over `sp` and Megatron over
            `tp`), the encoders and the VAE are placed on it.
        - `parallel`: the transformer's [`vidax_eqx.nn.sharding.ParallelConfig`][]
            (with `mesh`).
        - `scheduler`: a scheduler of [`vidax_eqx.sampling`][] instead of the folder's
            `scheduler/scheduler_config.json`.
        - `revision`, `cache_dir`: for a Hub id.
        - `compile_cache`: switch on JAX's persistent compilation cache
            ([`enable_compile_cache`][vidax_eqx.pipelines.enable_compile_cache]: a
            folder under the user's cache directory, so that a second process reuses
            the compiled programs); `False`, or `VIDAX_COMPILE_CACHE=0` in the
            environment, leaves JAX's setting as it is.
        - `offload`: where the components live on one accelerator (the memory plan,
            [`MemoryPlan`][vidax_eqx.pipelines.MemoryPlan], made before any weight is
            read from the components loaded abstractly and the compiler's memory
            analysis of each stage at the family's default call size): `"auto"`
            (default: the fastest plan that fits), `"none"` (everything resident),
            `"model"` (every component in host memory, moved in for its stage),
            `"cpu"` (the text and image encoders computed on the host CPU), `"blocks"`
            (the transformer's blocks streamed from host memory inside the compiled
            step, each block's weights copied in for its step). A plan that cannot fit raises
            `ValueError` naming each component's bytes and the budget, before any
            weight is read. `pipe.placement` says where each component went.
        - `device_memory`: the bytes the plan may use on the accelerator, weights and
            the stages' working memory together: an int or a size with a unit
            (`"8GB"`, `"512MiB"`). Default: the capacity JAX reports (on a CPU backend
            no limit).
        - `plan_video`: `(height, width, num_frames)`, the video the stages' working
            memory is measured for (default the family's call defaults); a larger call
            makes the plan again for its own size before it runs.
        - `host_memory`: the bytes of the machine's memory the plan may keep components
            in (host memory, the host CPU, streamed blocks); default its physical
            memory. A plan whose components kept off the device do not fit raises
            `ValueError` before any weight is read (Wan 2.2 A14B's two bf16 experts,
            56 GB, streamed on a machine of 40 GiB).
        - `quantize`: `"int8-weights"` or `"int8"` (weights and activations): the
            transformer's block layers in int8 ([`vidax_eqx.models.quantize`][]), half
            their bytes, planned as such; under a memory plan the float weights are
            read and quantized on the host CPU before they go where the plan says.
        """
        if compile_cache:
            enable_compile_cache()
        folder = PipelineFolder(path, owner=cls.__name__, classes=cls.pipeline_classes,
                                revision=revision, cache_dir=cache_dir)
        if parallel is None:
            parallel = parallel_for(mesh)
        encoder_dtype = text_encoder_dtype or dtype or jnp.float32
        if quantize not in models.QUANTIZE:  # (before any file is read)
            raise ValueError(f"{cls.__name__}.from_pretrained: `quantize` must be one of "
                             f"{models.QUANTIZE}; received {quantize!r}.")

        def build():
            components = cls.load_components(folder, dtype=dtype, vae_dtype=vae_dtype,
                                             encoder_dtype=encoder_dtype, parallel=parallel,
                                             mesh=mesh)
            components["transformer"] = models_internal.quantize_to(
                components["transformer"], quantize, cls.__name__)
            tokenizer = text_encoder = None
            if folder.has("tokenizer"):
                tokenizer = interop.TextTokenizer.from_pretrained(
                    folder.path("tokenizer", needed_for="a prompt"))
            if folder.has("text_encoder"):
                text_encoder = load_text_encoder(folder.path("text_encoder", needed_for="a prompt"),
                                                 dtype=encoder_dtype, mesh=mesh)
            return cls(tokenizer=tokenizer, text_encoder=text_encoder, scheduler=scheduler,
                       mesh=mesh, **components)

        if scheduler is None:
            scheduler = sampling.scheduler_from_config(
                folder.path("scheduler", needed_for="sampling (pass `scheduler=`)"))
        video = dict(zip(("height", "width", "num_frames"), plan_video or (None, None, None)))
        if offload in ("auto", "none") and device_memory is None and (
                mesh is not None or jax.devices()[0].platform == "cpu"):
            # No budget and nothing asked to move: everything resident, no plan to make first.
            pipe = build()
            pipe.apply_memory_plan(pipe.plan_memory(offload, host_memory=host_memory, **video))
            return pipe
        with interop.loading(lambda module: interop.ABSTRACT):
            abstract = build()  # every name and shape checked, nothing read
        plan = abstract.plan_memory(offload, device_memory, host_memory=host_memory, **video)
        where = {}  # the loads of what the plan keeps off the device go to host memory
        host = jax.devices("cpu")[0]
        for name, place in plan.placement.items():
            component = getattr(abstract, name)
            experts = component.experts if isinstance(component, models.AbstractExperts) else ()
            off = place != "device" or (quantize is not None and name == "transformer")
            for part in (component, *experts):  # (int8: quantized on the host, then placed)
                where[type(part)] = host if off else None
        with interop.loading(lambda module: where.get(type(module))):
            pipe = build()
        pipe.apply_memory_plan(plan)
        return pipe

    @classmethod
    @abc.abstractmethod
    def load_components(cls, folder: PipelineFolder, *, dtype, vae_dtype, encoder_dtype,
                        parallel, mesh) -> dict:
        """The family's components from the folder, as keywords of the constructor: the
        `transformer` (in its sharded layout on `mesh`), the `vae`, and any other
        (image encoder, folder settings)."""

    # -- what the components say --------------------------------------------------------

    @property
    @abc.abstractmethod
    def transformer_config(self):
        """The transformer's config (the first expert's for two experts)."""

    @property
    def transformer_dtype(self) -> jnp.dtype:
        return dtype_of(self.transformer)

    @property
    @abc.abstractmethod
    def image_conditioned(self) -> bool:
        """Whether the transformer takes an image."""

    @property
    def fixed_text_length(self) -> int | None:
        """The only text length the transformer takes (a positional embedding over the
        text), `None` for any."""
        return None

    @property
    def call_defaults(self) -> CallDefaults:
        """The class's `defaults`, with the prompt length the transformer requires when
        it fixes one."""
        fixed = self.fixed_text_length
        if fixed is None:
            return self.defaults
        return dataclasses.replace(self.defaults, max_sequence_length=fixed)

    @abc.abstractmethod
    def check_size(self, height, width, num_frames) -> tuple[int, int, int]:
        """The latent `(F, h, w)` of a `num_frames x height x width` video; a `ValueError`
        naming the nearest sizes that work when the VAE and the patch size do not divide
        them."""

    @abc.abstractmethod
    def latent_shape(self, batch: int, grid: tuple[int, int, int]) -> tuple[int, ...]:
        """The initial latents' shape for `batch` videos of latent `grid = (F, h, w)`, in
        the transformer's layout."""

    # -- stages -------------------------------------------------------------------------

    def encode_prompt(self, prompt, negative_prompt=None, *, do_classifier_free_guidance=True,
                      num_videos_per_prompt: int = 1, max_sequence_length: int | None = None):
        """diffusers' `encode_prompt`: `(prompt_embeds, negative_prompt_embeds)`,
        `(B * num_videos_per_prompt, max_sequence_length, text_dim)` in the text
        encoder's dtype; the negative `None` without guidance. The prompts (cleaned
        first with `clean_prompts`: [`vidax_eqx.interop.prompt_clean`][]) are tokenized
        to `max_sequence_length` (default the call's) and encoded in one compiled call,
        the negative ones with them; with `masked_text`, the encoder takes the attention
        mask and each row is zero past its tokens, else it sees the padding and its
        output there is kept."""
        length = self.call_defaults.max_sequence_length if max_sequence_length is None else (
            max_sequence_length)
        return encode_prompts(type(self).__name__, self, prompt, negative_prompt,
                              guided=do_classifier_free_guidance,
                              num_videos_per_prompt=num_videos_per_prompt,
                              max_sequence_length=length, clean=self.clean_prompts,
                              masked=self.masked_text)

    @abc.abstractmethod
    def check_image(self, *, image, last_image, image_embeds, image_latents,
                    num_frames: int) -> bool:
        """Raises on image arguments the transformer does not take (or a missing image it
        needs); whether the call has an `"image"` stage."""

    @abc.abstractmethod
    def image_condition(self, *, image, last_image, image_embeds, image_latents,
                        height: int, width: int, num_frames: int, grid, batch: int, dtype,
                        key) -> tuple[jax.Array, dict]:
        """The `"image"` stage: `(condition, model_kwargs)`, the condition as
        [`vidax_eqx.sampling.sample`][] takes it and further per-example model arguments
        (CLIP features); `key` the call's seed key."""

    def model_arguments(self, batch: int, family) -> dict:
        """The family's per-example model arguments of a call of `batch` videos (arrays
        `(batch, ...)`, e.g. SkyReels-V2's fps index), from the call's `family` options
        (the family's own call sets them; `None` for a family without any). None by
        default."""
        return {}

    def noise_shape(self, batch: int, grid, family) -> tuple[int, ...]:
        """The shape of a call's initial latents (its `latents=`, or the seed's draw):
        [`latent_shape`][vidax_eqx.pipelines.AbstractVideoPipeline.latent_shape] by
        default; a family that draws more (SkyReels-V2's windows) says so from its
        `family` options."""
        return self.latent_shape(batch, grid)

    def denoise(self, noise, *, condition, seed_key, family, call: dict, sample) -> jax.Array:
        """The `"denoise"` stage: the final latents from the initial ones. `sample` is
        [`vidax_eqx.sampling.sample`][] with the model, the text and the call's settings
        bound (`sample(noise, condition=..., **more)`), `call` the call's further
        [`vidax_eqx.sampling.sample`][] keywords, `family` the family's options of the
        call, `seed_key` the call's seed key. One `sample` call by default; a family may
        run several (SkyReels-V2's windows of a long video)."""
        return sample(noise, condition=condition, **call)

    @abc.abstractmethod
    def decode(self, latents) -> np.ndarray:
        """diffusers' decode and `postprocess_video(output_type="np")`: the final
        latents (a device array or NumPy, the transformer's layout) to frames
        `(B, F, H, W, 3)` float32 NumPy in [0, 1], one video at a time through the VAE
        (split over the mesh)."""

    def text_context(self, prompt, negative_prompt, prompt_embeds, negative_prompt_embeds, *,
                     guided: bool, num_videos_per_prompt: int, max_sequence_length: int):
        """The `"text"` stage: `(context, negative)` in the transformer's dtype, from the
        prompts (encoded) or the embeddings given; `negative` is `None` without
        guidance."""
        owner = type(self).__name__
        if prompt_embeds is None:
            if negative_prompt_embeds is not None:
                raise ValueError(f"{owner}: `negative_prompt_embeds` goes with "
                                 "`prompt_embeds`; pass `negative_prompt` with `prompt`.")
            self.check_text_length("max_sequence_length", max_sequence_length)
            context, negative = self.encode_prompt(
                prompt, negative_prompt, do_classifier_free_guidance=guided,
                num_videos_per_prompt=num_videos_per_prompt,
                max_sequence_length=max_sequence_length)
        else:
            context, negative = given_embeddings(
                owner, prompt, negative_prompt, prompt_embeds, negative_prompt_embeds,
                guided=guided, num_videos_per_prompt=num_videos_per_prompt)
            self.check_text_length("prompt_embeds.shape[1]", context.shape[1])
        dtype = self.transformer_dtype
        context = jax.block_until_ready(context.astype(dtype))
        negative = None if not guided or negative is None else negative.astype(dtype)
        return context, negative

    def check_text_length(self, name: str, length: int) -> None:
        """Raises unless the transformer takes `length` text tokens."""
        expected = self.fixed_text_length
        if expected is not None and length != expected:
            raise ValueError(
                f"{type(self).__name__}: `{name}` must be the transformer's "
                f"max_text_seq_length ({expected}): its positional embedding covers that many "
                f"text tokens (diffusers fails on any other length); received {length}.")

    # -- the call -----------------------------------------------------------------------

    def __call__(self, prompt=None, negative_prompt=None, *, image=None, last_image=None,
                 height: int | None = None, width: int | None = None,
                 num_frames: int | None = None, num_inference_steps: int | None = None,
                 guidance_scale: float | None = None, guidance_scale_2: float | None = None,
                 use_dynamic_cfg: bool = False, num_videos_per_prompt: int = 1, seed: int = 0,
                 latents=None, prompt_embeds=None, negative_prompt_embeds=None,
                 image_embeds=None, image_latents=None, output_type: str = "np",
                 max_sequence_length: int | None = None, progress=True, report=None,
                 family=None, **sample_kwargs) -> PipelineOutput:
        """Generates videos: text (and image) encoding, the denoising loop and the decode,
        each compiled.

        **Arguments** (diffusers' names; `None`: the family's
        [`call_defaults`][vidax_eqx.pipelines.AbstractVideoPipeline.call_defaults]):

        - `prompt`, `negative_prompt`: a str or a list (one video per prompt and
            `num_videos_per_prompt`); the negative prompt is used when
            `guidance_scale > 1` (default `""`), one str for all or one per prompt.
        - `image`: image-to-video: the first frame (a PIL image or an `(H, W, 3)` array,
            uint8 or float in [0, 1]), resized to `height x width` with Lanczos as
            diffusers does. Required by an image-to-video transformer, refused by a
            text-to-video one (Wan 2.2 TI2V: optional). `last_image`: Wan FLF2V's last
            frame.
        - `height`, `width`, `num_frames`: the video's size (see the family's note).
        - `num_inference_steps`, `guidance_scale`; `guidance_scale_2` (Wan 2.2 A14B's
            low-noise expert; default `guidance_scale`); `use_dynamic_cfg` (CogVideoX's
            cosine guidance schedule): [`vidax_eqx.sampling.Guidance`][]'s.
        - `seed`: the initial latents are `jax.random.normal(jax.random.key(seed),
            shape, float32)` in the transformer's layout (other draws come from keys
            folded from it: a stochastic scheduler's from stream 2); or `latents`: those
            latents, e.g. diffusers' own draw, to reproduce a diffusers run.
        - `prompt_embeds`, `negative_prompt_embeds`: `(B, L, text_dim)` embeddings instead
            of `prompt` / `negative_prompt`.
        - `image_embeds` (Wan: CLIP features `(1 or B, L_img, image_dim)` instead of
            encoding `image`), `image_latents` (CogVideoX: the image's scaled latents
            instead of encoding it).
        - `output_type`: `"np"` (frames) or `"latent"` (no decode).
        - `max_sequence_length`: the prompt's token length.
        - `progress`: the denoising loop's progress, [`vidax_eqx.sampling.sample`][]'s
            (`True`: a tqdm bar on a terminal; a callable told each step).
        - `report`: called as `report(stage, seconds)` after each stage.
        - `family`: the family's own options of the call, a typed value its hooks read
            (SkyReels-V2's `SkyReelsOptions`, set by its call from its keywords); `None`
            for a family without any.
        - `**sample_kwargs`: further [`vidax_eqx.sampling.sample`][] arguments
            (`caching=`, `compilation=`, `key=`, model arguments such as `remat`).

        **Returns:**

        A [`PipelineOutput`][vidax_eqx.pipelines.PipelineOutput]: `frames` `(B, F, H,
        W, 3)` in [0, 1], the final `latents` in the transformer's layout, the stage
        `timings`.
        """
        owner = type(self).__name__
        defaults = self.call_defaults
        height = defaults.height if height is None else height
        width = defaults.width if width is None else width
        num_frames = defaults.num_frames if num_frames is None else num_frames
        steps = defaults.num_inference_steps if num_inference_steps is None else (
            num_inference_steps)
        scale = defaults.guidance_scale if guidance_scale is None else guidance_scale
        length = defaults.max_sequence_length if max_sequence_length is None else (
            max_sequence_length)
        if output_type not in ("np", "latent"):
            raise ValueError(f"{owner}: `output_type` must be 'np' or 'latent'; received "
                             f"{output_type!r}.")
        grid = self.check_size(height, width, num_frames)
        self._plan_for_call(height, width, num_frames)
        n = check_int(owner, "num_videos_per_prompt", num_videos_per_prompt, 1)
        seed_key = jax.random.key(_check_seed(owner, seed))
        guidance = sampling.Guidance(scale=scale, scale_2=guidance_scale_2,
                                     dynamic=use_dynamic_cfg)
        guided = guidance.guided
        images = dict(image=image, last_image=last_image, image_embeds=image_embeds,
                      image_latents=image_latents)
        has_image = self.check_image(**images, num_frames=num_frames)
        timer = StageTimer(report)
        dtype = self.transformer_dtype

        with timer("text"), self._residency.stage(self, "text"):
            context, negative = self._residency.to_device(self.text_context(
                prompt, negative_prompt, prompt_embeds, negative_prompt_embeds, guided=guided,
                num_videos_per_prompt=n, max_sequence_length=length))
        batch = context.shape[0]

        kwargs = dict(sample_kwargs)
        condition, model_kwargs = None, self.model_arguments(batch, family)
        if has_image:
            with timer("image"), self._residency.stage(self, "image"):
                condition, image_kwargs = self._residency.to_device(self.image_condition(
                    **images, height=height, width=width, num_frames=num_frames, grid=grid,
                    batch=batch, dtype=dtype, key=seed_key))
                model_kwargs.update(image_kwargs)
                condition = jax.block_until_ready(condition)

        shape = self.noise_shape(batch, grid, family)
        if latents is None:
            noise = jax.random.normal(seed_key, shape, jnp.float32)
        else:
            noise = jnp.asarray(latents, jnp.float32)
            if noise.shape != shape:
                raise ValueError(
                    f"{owner}: `latents` must be the initial latents {self.latent_layout} = "
                    f"{shape} for {batch} videos of {num_frames} x {height} x {width}; "
                    f"received shape {noise.shape}.")
        if self.scheduler.stochastic:  # its noise from the seed, unless a key is given
            kwargs.setdefault("key", jax.random.fold_in(seed_key, SCHEDULER_STREAM))
        placement = sampling.Placement(mesh=self.mesh, batch_axis=self.batch_axis,
                                       cfg_axis=self.cfg_axis if guided else None)

        with timer("denoise"), self._residency.stage(self, "denoise"):
            sample = functools.partial(
                sampling.sample, self.transformer, context=context, negative_context=negative,
                steps=steps, scheduler=self.scheduler, guidance=guidance, placement=placement,
                progress=progress, **model_kwargs)
            out = self.denoise(noise, condition=condition, seed_key=seed_key, family=family,
                               call=kwargs,
                               sample=sample)
            out = jax.block_until_ready(out)
        frames = None
        if output_type == "np":
            with timer("decode"), self._residency.stage(self, "decode"):
                frames = self.decode(out)
        return PipelineOutput(frames=frames, latents=np.asarray(jax.device_get(out), np.float32),
                              timings=dict(timer.timings))
