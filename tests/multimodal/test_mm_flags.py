"""The multimodal flags (issue 24) reach the engine config: --limit-mm-per-prompt as JSON or
vLLM's older image=2,video=1, --mm-processor-kwargs, the media fetching flags; bad values are
refused by name."""
from __future__ import annotations

import argparse

import pytest

from folio.config import MultiModalConfig, multimodal_config
from folio.entrypoints.openai.cli_args import add_serve_args, build_engine_config


def _config(*argv: str):
    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    return build_engine_config(parser.parse_args(list(argv))).multimodal


def test_flags_reach_the_config() -> None:
    mm = _config("--limit-mm-per-prompt", '{"image": 2, "video": 0}',
                 "--mm-processor-kwargs", '{"max_pixels": 1000000}',
                 "--allowed-media-domains", "images.example.com", "cdn.example.org",
                 "--allow-private-media-urls", "--max-media-bytes", "1000",
                 "--media-fetch-timeout", "3", "--max-image-pixels", "4000000",
                 "--allowed-local-media-path", "/tmp")
    assert mm.limit("image") == 2 and mm.limit("video") == 0 and mm.limit("audio") == 0
    assert mm.mm_processor_kwargs == {"max_pixels": 1000000}
    media = mm.media
    assert media.allowed_media_domains == ["images.example.com", "cdn.example.org"]
    assert media.allow_private_media_urls and media.max_media_bytes == 1000
    assert media.timeout == 3 and media.max_image_pixels == 4000000
    assert media.allowed_local_media_path == "/tmp"
    assert _config("--limit-mm-per-prompt", "image=3,video=1").limit_mm_per_prompt == {
        "image": 3, "video": 1}


def test_the_defaults_are_safe_and_bounded() -> None:
    mm = _config()
    assert mm.limit("image") == 4 and mm.limit("video") == 1
    assert not mm.media.allow_private_media_urls and mm.media.allowed_media_domains is None
    assert mm.media.allowed_local_media_path is None


@pytest.mark.parametrize("limits, match", [
    ({"image": -1}, "limit_mm_per_prompt.image"), ({"image": 1000}, "limit_mm_per_prompt"),
    ({"smell": 1}, "modalities"), ({"image": True}, "limit_mm_per_prompt.image")])
def test_bad_limits_are_refused_by_name(limits, match) -> None:
    with pytest.raises(ValueError, match=match):
        MultiModalConfig(limit_mm_per_prompt=limits)


def test_bad_flag_values() -> None:
    with pytest.raises(ValueError, match="not valid JSON"):
        multimodal_config("{image: 2")
    with pytest.raises(ValueError, match="max_media_bytes"):
        multimodal_config(max_media_bytes=0)
    with pytest.raises(SystemExit):
        _config("--limit-mm-per-prompt", "image")
