"""A tiny random Qwen2-VL (vision transformer with 2D rotary positions and a 2 x 2 patch
merger, M-RoPE Qwen2 decoder) saved from transformers' config, with its image processor and
the default model's tokenizer (Qwen2-VL's vision tokens added); and transformers' greedy
answer for it, the reference folio is checked against."""
from __future__ import annotations

from typing import Any

import numpy as np
import torch

VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
# The processor's bounds: images resized to 4 .. 64 merged tokens.
MIN_PIXELS, MAX_PIXELS = 56 * 56, 28 * 28 * 64


def _build(out: str, qwen2_5: bool, vision: dict, seed: int, tokenizer: str | None) -> str:
    """A tiny random Qwen2-VL (or Qwen2.5-VL) with the default model's tokenizer (the vision
    tokens added) and an image processor bounded to MIN_PIXELS .. MAX_PIXELS, saved to `out`."""
    import transformers
    from transformers import AutoTokenizer
    try:
        from transformers import Qwen2VLImageProcessorPil as ImageProcessor
    except ImportError:
        from transformers import Qwen2VLImageProcessor as ImageProcessor

    from folio.model.default_model import default_model_path
    prefix = "Qwen2_5_VL" if qwen2_5 else "Qwen2VL"
    tok = AutoTokenizer.from_pretrained(tokenizer or default_model_path())
    tok.add_special_tokens({"additional_special_tokens": VISION_TOKENS})
    start, end, image, video = tok.convert_tokens_to_ids(VISION_TOKENS)
    config = getattr(transformers, f"{prefix}Config")(
        text_config=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=len(tok),
                         max_position_embeddings=512, rope_theta=10000.0,
                         rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]},
                         bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id),
        vision_config=dict(num_heads=4, patch_size=14, spatial_merge_size=2,
                           temporal_patch_size=2, **vision),
        vision_start_token_id=start, vision_end_token_id=end, image_token_id=image,
        video_token_id=video, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    torch.manual_seed(seed)
    getattr(transformers, f"{prefix}ForConditionalGeneration")(config).eval().save_pretrained(out)
    ImageProcessor(size={"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS}
                   ).save_pretrained(out)
    tok.save_pretrained(out)
    return out


def build_tiny_qwen2_vl(out: str, seed: int = 7, tokenizer: str | None = None) -> str:
    return _build(out, False, dict(depth=2, embed_dim=32, hidden_size=64, mlp_ratio=2),
                  seed, tokenizer)


def build_tiny_qwen2_5_vl(out: str, seed: int = 9, tokenizer: str | None = None) -> str:
    """RMSNorm and gated-MLP vision blocks, window attention over 2 x 2 merged tokens (56 px)
    in block 0, full attention in block 1."""
    return _build(out, True, dict(depth=2, hidden_size=32, out_hidden_size=64,
                                  intermediate_size=48, window_size=56,
                                  fullatt_block_indexes=[1]), seed, tokenizer)


def hf_qwen2_vl_greedy(model_dir: str, prompt: str, images: list[Any], max_new_tokens: int,
                       add_special_tokens: bool = True) -> list[int]:
    """transformers' greedy continuation of `prompt` (one IMAGE per image) and `images`:
    the processor's pixel values, each <|image_pad|> expanded to the image's grid as
    Qwen2VLProcessor does, the model's own M-RoPE positions."""
    from transformers import AutoModelForImageTextToText, AutoTokenizer
    try:
        from transformers import Qwen2VLImageProcessorPil as ImageProcessor
    except ImportError:
        from transformers import Qwen2VLImageProcessor as ImageProcessor
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    kwargs: dict[str, Any] = {}
    if images:
        pixels = ImageProcessor.from_pretrained(model_dir)(images=images, return_tensors="pt")
        counts = iter((pixels["image_grid_thw"].prod(-1) // 4).tolist())
        pieces = prompt.split("<|image_pad|>")
        prompt = pieces[0] + "".join("<|image_pad|>" * next(counts) + p for p in pieces[1:])
        kwargs = {"pixel_values": pixels["pixel_values"],
                  "image_grid_thw": pixels["image_grid_thw"]}
    ids = torch.tensor([tok(prompt, add_special_tokens=add_special_tokens)["input_ids"]])
    image_id = tok.convert_tokens_to_ids("<|image_pad|>")
    kwargs["mm_token_type_ids"] = (ids == image_id).int()
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                             max_new_tokens=max_new_tokens, do_sample=False, **kwargs)
    return out[0, ids.shape[1]:].tolist()


def random_image(seed: int, size: tuple[int, int]):
    from PIL import Image
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))



VIDEO = "<|vision_start|><|video_pad|><|vision_end|>"


def hf_qwen2_vl_video_greedy(model_dir: str, prompt: str, frames: list, max_new_tokens: int
                             ) -> list[int]:
    """transformers' greedy continuation of `prompt` (one VIDEO) with the video's frames:
    the patches as folio's processor lays them out (transformers' video processor needs
    torchvision, which this machine lacks), the model's own vision tower and M-RoPE."""
    from transformers import AutoModelForImageTextToText, AutoTokenizer

    from folio.multimodal.processing import Qwen2VLProcessorAdapter
    adapter = Qwen2VLProcessorAdapter.from_pretrained(model_dir)
    pixels, grid, _ = adapter.video_inputs(frames)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    count = int(np.prod(grid)) // 4
    ids = torch.tensor([tok(prompt.replace("<|video_pad|>", "<|video_pad|>" * count))[
        "input_ids"]])
    video_id = tok.convert_tokens_to_ids("<|video_pad|>")
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                             pixel_values_videos=torch.from_numpy(pixels),
                             video_grid_thw=torch.tensor([grid]),
                             mm_token_type_ids=(ids == video_id).int() * 2,
                             max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, ids.shape[1]:].tolist()
