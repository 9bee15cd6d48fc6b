"""The LLaVA vision encoder (CLIP tower + projector) against transformers on a tiny random
LlavaForConditionalGeneration (float32, CPU): the same image features, for the feature
layers and select strategies LLaVA models use, loaded from the checkpoint's names."""
from __future__ import annotations

import pytest
import torch

from folio.model.vision.clip_vision import LlavaVisionEncoder, load_llava_vision


def _tiny_llava(feature_layer, strategy, act="quick_gelu"):
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration
    torch.manual_seed(0)
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                              num_attention_heads=4, image_size=56, patch_size=14,
                              hidden_act=act, projection_dim=32)
    text = LlamaConfig(hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, vocab_size=320)
    config = LlavaConfig(vision_config=vision, text_config=text, image_token_index=300,
                         vision_feature_layer=feature_layer,
                         vision_feature_select_strategy=strategy)
    return LlavaForConditionalGeneration(config).eval()


@pytest.mark.parametrize("feature_layer, strategy, act", [
    (-2, "default", "quick_gelu"), (-1, "full", "gelu"), ([-3, -1], "default", "quick_gelu"),
    (1, "default", "quick_gelu"),
])
def test_image_features_match_transformers(feature_layer, strategy, act) -> None:
    model = _tiny_llava(feature_layer, strategy, act)
    ours = LlavaVisionEncoder.from_hf_config(model.config)
    missing = load_llava_vision(ours, model.state_dict().items())
    assert missing == []
    pixels = torch.randn(3, 3, 56, 56)
    with torch.no_grad():
        want = model.model.get_image_features(
            pixel_values=pixels, vision_feature_layer=feature_layer,
            vision_feature_select_strategy=strategy).pooler_output
    want = torch.stack(list(want))
    got = ours(pixels)
    assert got.shape == want.shape == (3, ours.tokens_per_image, 48)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # only the layers the feature layer needs are built (LLaVA's -2: not the last)
    needed = max(i if i >= 0 else 4 + i for i in
                 ([feature_layer] if isinstance(feature_layer, int) else feature_layer))
    assert len(ours.layers) == needed


def test_a_wrong_shape_or_layer_is_refused() -> None:
    model = _tiny_llava(-2, "default")
    ours = LlavaVisionEncoder.from_hf_config(model.config)
    bad = [("model.multi_modal_projector.linear_1.weight", torch.zeros(3, 3))]
    with pytest.raises(ValueError, match="linear_1.weight: shape"):
        load_llava_vision(ours, bad)
    with pytest.raises(ValueError, match="outside"):
        LlavaVisionEncoder(ours.spec, 48, feature_layer=7)


def test_loads_from_the_saved_checkpoints_names(tmp_path) -> None:
    """save_pretrained writes vision_tower.* and multi_modal_projector.* (and llava-hf's
    older checkpoints vision_tower.vision_model.*): both load."""
    from safetensors.torch import load_file
    model = _tiny_llava(-2, "default")
    model.save_pretrained(tmp_path)
    tensors = {}
    for path in tmp_path.glob("*.safetensors"):
        tensors.update(load_file(path))
    pixels = torch.randn(1, 3, 56, 56)
    want = None
    for names in (tensors, {k.replace("vision_tower.", "vision_tower.vision_model."): v
                            for k, v in tensors.items()}):
        ours = LlavaVisionEncoder.from_hf_config(model.config)
        assert load_llava_vision(ours, names.items()) == []
        got = ours(pixels)
        if want is None:
            want = got
        torch.testing.assert_close(got, want)
