"""The input embeddings of a step whose tokens include image placeholders (a vision-language
model, issue 24): the tokens' embeddings, with each image's features written over its
placeholder tokens. Features are computed once per image content (the encoder-output cache,
keyed by the image's hash, bounded in entries) and sliced when chunked prefill splits an
image's tokens over steps."""
from __future__ import annotations

from collections import OrderedDict

import numpy as np
import torch

from folio.core.step_messages import SchedulerOutput

# Images whose features are kept (LRU): the same image in later requests, or in the next
# chunk of a split prompt, is not encoded again.
ENCODER_CACHE_ENTRIES = 64


class ImageEmbedder:
    def __init__(self, encoder: torch.nn.Module, device: torch.device,
                 max_entries: int = ENCODER_CACHE_ENTRIES) -> None:
        self.encoder = encoder
        self.device = device
        self.max_entries = max_entries
        self._cache: OrderedDict[str, torch.Tensor] = OrderedDict()
        self.num_encoded = 0      # images run through the encoder (for tests and logs)

    def spans(self, step: SchedulerOutput, requests) -> list[tuple[int, object, int, int]]:
        """(flat row of the overlap's first token, image, first feature, feature count) for
        every image whose placeholder tokens this step runs; [] for most steps."""
        out = []
        row = 0
        for rid, n in step.num_scheduled_tokens.items():
            state = requests[rid]
            images = state.mm_inputs
            if images:
                start = state.num_computed_tokens
                end = start + n
                for image in images:
                    lo, hi = max(start, image.offset), min(end, image.offset + image.length)
                    if lo < hi:
                        out.append((row + lo - start, image, lo - image.offset, hi - lo))
            row += n
        return out

    def features(self, image) -> torch.Tensor:
        cached = self._cache.get(image.content_hash)
        if cached is not None:
            self._cache.move_to_end(image.content_hash)
            return cached
        dtype = next(self.encoder.parameters()).dtype
        pixels = torch.from_numpy(np.frombuffer(image.pixel_values, dtype="<f4").reshape(
            image.shape).copy()).to(self.device, dtype)
        features = self.encoder(pixels[None])[0]
        if features.shape[0] != image.length:
            raise ValueError(f"the image encoder made {features.shape[0]} features for "
                             f"{image.length} placeholder tokens")
        self.num_encoded += 1
        self._cache[image.content_hash] = features
        while len(self._cache) > self.max_entries:
            self._cache.popitem(last=False)
        return features

    def embeds(self, model, input_ids: torch.Tensor,
               spans: list[tuple[int, object, int, int]]) -> torch.Tensor:
        hidden = model.embed(input_ids)
        for row, image, first, count in spans:
            hidden[row:row + count] = self.features(image)[first:first + count].to(hidden.dtype)
        return hidden
