"""The input embeddings of a step whose tokens include image placeholders (a vision-language
model, issue 24): the tokens' embeddings, with each image's features written over its
placeholder tokens. The step's images not yet encoded run through the encoder together, in
passes of at most `max_pass_tokens` features (one image at least: the pass the start-up
memory profile measured, so the encoder never peaks above what the KV cache was sized
around). Features are kept per image
content (the encoder-output cache, keyed by the image's hash, bounded in entries) and sliced
when chunked prefill splits an image's tokens over steps."""
from __future__ import annotations

import math
from collections import OrderedDict

import numpy as np
import torch

from folio.core.step_messages import SchedulerOutput

# Images whose features are kept (LRU): the same image in later requests, or in the next
# chunk of a split prompt, is not encoded again.
ENCODER_CACHE_ENTRIES = 64


def max_encoder_tokens(max_step_tokens: int, largest_image_tokens: int,
                       images_per_prompt: int, max_num_seqs: int) -> int:
    """Features one encoder pass makes at most: the whole images one step's token budget
    holds (at least one of the largest), and never more than the step's requests may
    carry."""
    largest = max(1, largest_image_tokens)
    by_tokens = max(1, math.ceil(max_step_tokens / largest))
    return largest * max(1, min(by_tokens, max(1, images_per_prompt) * max_num_seqs))


class ImageEmbedder:
    def __init__(self, encoder: torch.nn.Module, device: torch.device,
                 max_pass_tokens: int = 1, max_entries: int = ENCODER_CACHE_ENTRIES) -> None:
        self.encoder = encoder
        self.device = device
        self.max_pass_tokens = max_pass_tokens
        self.max_entries = max_entries
        self._cache: OrderedDict[str, torch.Tensor] = OrderedDict()
        self.num_encoded = 0      # images run through the encoder (for tests and logs)
        self.num_passes = 0       # encoder passes (batches)

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

    def _pixels(self, image) -> torch.Tensor:
        return torch.from_numpy(np.frombuffer(image.pixel_values, dtype="<f4").reshape(
            image.shape).copy())

    def _encode(self, images: list) -> dict[str, torch.Tensor]:
        """Features of `images` (distinct contents), in passes of at most max_pass_tokens
        features (one image at least)."""
        dtype = next(self.encoder.parameters()).dtype
        out: dict[str, torch.Tensor] = {}
        passes: list[list] = [[]]
        tokens = 0
        for image in images:
            if passes[-1] and tokens + image.length > self.max_pass_tokens:
                passes.append([])
                tokens = 0
            passes[-1].append(image)
            tokens += image.length
        for batch in passes:
            pixels = [self._pixels(image).to(self.device, dtype) for image in batch]
            features = self.encoder.encode_batch(pixels, [image.grid_thw for image in batch])
            self.num_passes += 1
            for image, feature in zip(batch, features):
                if feature.shape[0] != image.length:
                    raise ValueError(f"the image encoder made {feature.shape[0]} features "
                                     f"for {image.length} placeholder tokens")
                out[image.content_hash] = feature
        self.num_encoded += len(out)
        return out

    def features(self, spans: list[tuple[int, object, int, int]]) -> dict[str, torch.Tensor]:
        """Each span's image features by content hash: from the cache, or encoded now (all
        of the step's new images together)."""
        found: dict[str, torch.Tensor] = {}
        missing: dict[str, object] = {}
        for _, image, _, _ in spans:
            key = image.content_hash
            if key in found or key in missing:
                continue
            cached = self._cache.get(key)
            if cached is not None:
                self._cache.move_to_end(key)
                found[key] = cached
            else:
                missing[key] = image
        if missing:
            encoded = self._encode(list(missing.values()))
            found.update(encoded)
            self._cache.update(encoded)
            while len(self._cache) > self.max_entries:
                self._cache.popitem(last=False)
        return found

    def embeds(self, model, input_ids: torch.Tensor,
               spans: list[tuple[int, object, int, int]]) -> torch.Tensor:
        hidden = model.embed(input_ids)
        features = self.features(spans)
        for row, image, first, count in spans:
            hidden[row:row + count] = features[image.content_hash][first:first + count].to(
                hidden.dtype)
        return hidden

    def profile(self) -> torch.Tensor:
        """The encoder on its largest pass of blank images (start-up memory profiling), and
        a full encoder-output cache's worth of features: to be held while the decoder's
        profile pass runs, as a step holds them."""
        pixels, grids = self.encoder.profile_batch(self.max_pass_tokens)
        features = torch.cat(self.encoder.encode_batch(pixels, grids))
        largest = self.encoder.largest_image_tokens
        cache = features.new_empty((self.max_entries * largest, features.shape[-1]))
        return torch.cat([features, cache])
