"""A tiny random LLaVA-1.5-style checkpoint for the multimodal tests: CLIP vision tower,
projector, Llama decoder, the default model's tokenizer with an <image> token, and a
LlavaProcessor (CLIP preprocessing at 56 px: 16 image tokens), saved as a model directory
transformers and folio both load."""
from __future__ import annotations

from typing import Any

import torch

IMAGE_SIZE = 56
PATCH = 14
TOKENS_PER_IMAGE = (IMAGE_SIZE // PATCH) ** 2


def build_tiny_llava(out: str, seed: int = 11, tokenizer: str | None = None) -> str:
    """A tiny random LLaVA-1.5-style model (CLIP tower, projector, Llama decoder) and its
    processor, saved to `out`; the tokenizer is the default model's (or `tokenizer`'s) with
    an <image> token added."""
    from transformers import (AutoTokenizer, CLIPVisionConfig, LlamaConfig, LlavaConfig,
                              LlavaForConditionalGeneration, LlavaProcessor)
    try:
        from transformers import CLIPImageProcessorPil     # transformers >= 5.2x
    except ImportError:
        from transformers import CLIPImageProcessor as CLIPImageProcessorPil

    from folio.model.default_model import default_model_path
    tok = AutoTokenizer.from_pretrained(tokenizer or default_model_path())
    tok.add_special_tokens({"additional_special_tokens": ["<image>"]})
    image_token_id = tok.convert_tokens_to_ids("<image>")
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                              num_attention_heads=4, image_size=IMAGE_SIZE, patch_size=PATCH,
                              projection_dim=32)
    text = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, vocab_size=len(tok),
                       max_position_embeddings=512, bos_token_id=tok.bos_token_id,
                       eos_token_id=tok.eos_token_id)
    config = LlavaConfig(vision_config=vision, text_config=text,
                         image_token_index=image_token_id, vision_feature_layer=-2,
                         vision_feature_select_strategy="default", image_seq_length=TOKENS_PER_IMAGE)
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(config).eval()
    model.save_pretrained(out)
    images = CLIPImageProcessorPil(size={"shortest_edge": IMAGE_SIZE},
                                   crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})
    LlavaProcessor(image_processor=images, tokenizer=tok, patch_size=PATCH,
                   vision_feature_select_strategy="default", image_token="<image>",
                   num_additional_image_tokens=1).save_pretrained(out)
    return out


def hf_llava_greedy(model_dir: str, prompt: str, images: list[Any], max_new_tokens: int
                    ) -> list[int]:
    """transformers' greedy continuation of `prompt` (with its <image> placeholders) and
    `images`: the reference folio's answers are checked against."""
    from transformers import AutoProcessor, LlavaForConditionalGeneration
    processor = AutoProcessor.from_pretrained(model_dir)
    model = LlavaForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
    inputs = processor(text=[prompt], images=images or None, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, inputs["input_ids"].shape[1]:].tolist()
