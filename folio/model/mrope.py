"""M-RoPE positions (Qwen2-VL, issue 24): a prompt's tokens get positions in three rows
(time, height, width). Text tokens count on in all three rows alike; an image's tokens take
its merged patch grid's coordinates, offset by the position where the image starts; the text
after an image resumes past the image's largest side. Generated tokens continue the count:
position = token index + `delta` in every row. Torch-free (numpy), as transformers computes
them in Qwen2VLModel.get_rope_index."""
from __future__ import annotations

from typing import Sequence

import numpy as np


def mrope_positions(prompt_len: int, images: Sequence[tuple], merge: int
                    ) -> tuple[np.ndarray, int]:
    """([3, prompt_len] int64 positions, delta) for a prompt whose images and videos are
    (offset, length, grid [t, h, w] in patches[, time interval]) each; `merge`: the vision
    tower's spatial merge size (a token covers merge x merge patches); the time interval
    spaces a video's frame pairs (Qwen2.5-VL: tokens per second x seconds per pair)."""
    out = np.empty((3, prompt_len), dtype=np.int64)
    position = 0
    i = 0
    for offset, length, grid, *rest in sorted(images, key=lambda image: image[0]):
        interval = rest[0] if rest else 1.0
        out[:, i:offset] = position + np.arange(offset - i)
        position += offset - i
        t, h, w = (int(x) for x in grid)
        h, w = h // merge, w // merge
        if t * h * w != length:
            raise ValueError(f"an image of grid {list(grid)} has {t * h * w} tokens, not "
                             f"{length}")
        times = (np.arange(t) * interval).astype(np.int64)
        tt, hh, ww = np.meshgrid(times, np.arange(h), np.arange(w), indexing="ij")
        out[:, offset:offset + length] = np.stack([tt.ravel(), hh.ravel(), ww.ravel()]) \
            + position
        position += max(h, w)
        i = offset + length
    out[:, i:] = position + np.arange(prompt_len - i)
    delta = int(out.max()) + 1 - prompt_len if prompt_len else 0
    return out, delta
