"""Classifier-free guidance, the one formula every denoising loop applies."""


def guide(cond, uncond, scale):
    """`uncond + scale * (cond - uncond)`: the guided prediction from the conditional and
    unconditional ones (diffusers' `noise_uncond + guidance_scale * (noise_cond -
    noise_uncond)`); `scale` as the caller gives it (its dtype takes part in the
    promotion)."""
    return uncond + scale * (cond - uncond)
