"""The encoder-output cache's effect on TTFT at a real LLaVA-1.5-7B shape (issue 24, item 6):
a random-weight LlavaForConditionalGeneration (CLIP ViT-L/14 at 336 px, 576 image tokens;
Llama-2-7B decoder), written with its processor, served by `folio serve`, and measured with
`folio bench serve --dataset random-mm` (each image once, then the same images with other
texts). Run on the lent GPU through tools/device_issue24.sh PART=bench."""
from __future__ import annotations

import argparse
import os

import torch


def build(out: str) -> str:
    from transformers import (AutoTokenizer, CLIPVisionConfig, LlamaConfig, LlavaConfig,
                              LlavaForConditionalGeneration, LlavaProcessor)
    try:
        from transformers import CLIPImageProcessorPil as CLIPImageProcessor
    except ImportError:
        from transformers import CLIPImageProcessor
    tok = AutoTokenizer.from_pretrained(os.environ["FOLIO_RANDOM_TOKENIZER"])
    tok.add_special_tokens({"additional_special_tokens": ["<image>"]})
    vision = CLIPVisionConfig(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24,
                              num_attention_heads=16, image_size=336, patch_size=14,
                              projection_dim=768)
    text = LlamaConfig(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                       num_attention_heads=32, num_key_value_heads=32, vocab_size=len(tok),
                       max_position_embeddings=4096, bos_token_id=tok.bos_token_id,
                       eos_token_id=tok.eos_token_id)
    config = LlavaConfig(vision_config=vision, text_config=text,
                         image_token_index=tok.convert_tokens_to_ids("<image>"),
                         vision_feature_layer=-2, vision_feature_select_strategy="default",
                         image_seq_length=576)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlavaForConditionalGeneration(config).to(torch.bfloat16)
    for p in model.parameters():       # small weights: activations stay finite at 32 layers
        p.data.normal_(0, 0.02)
    model.save_pretrained(out)
    images = CLIPImageProcessor(size={"shortest_edge": 336},
                                crop_size={"height": 336, "width": 336})
    LlavaProcessor(image_processor=images, tokenizer=tok, patch_size=14,
                   vision_feature_select_strategy="default", image_token="<image>",
                   num_additional_image_tokens=1).save_pretrained(out)
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="/tmp/llava7b")
    print(build(parser.parse_args().out))
