"""PNG bytes from pixels, with PIL alone: what writes synthetic image folders in
processes that import neither TensorFlow nor Beam (`beam_jobs.synthetic_images`), and
`beam_jobs.schema.encode_png` for everything else."""

from __future__ import annotations

import io

import numpy as np
from PIL import Image


def encode_png(pixels: np.ndarray) -> bytes:
    """Encodes HxW or HxWx3 uint8 pixels as PNG."""
    if pixels.dtype != np.uint8 or pixels.ndim not in (2, 3):
        raise ValueError(f"expected uint8 HxW or HxWxC pixels, got {pixels.dtype} {pixels.shape}")
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()
