"""Images over the OpenAI chat API (issue 24) on a real `folio serve` of a tiny LLaVA-style
model: the official openai client sends a base64 image and streams the answer, which equals
transformers' greedy answer; image URLs are fetched under the server's media rules — a
loopback URL refused by default (400 naming the reason), served when the operator allows the
host; a redirect from an allowed host to a loopback one refused; a 100 MB body and a
20,000 x 20,000 PNG bomb refused for their size; file:// only under --allowed-local-media-path;
--limit-mm-per-prompt enforced; usage counts the images' tokens; /health stays green."""
from __future__ import annotations

import asyncio
import base64
import io
import json
import os
import sys
import threading

import httpx
import pytest
from aiohttp import web
from PIL import Image

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "entrypoints"))

from llava_utils import TOKENS_PER_IMAGE, build_tiny_llava, hf_llava_greedy  # noqa: E402
from server_utils import RemoteServer  # noqa: E402
from test_media_fetch import _bomb_png  # noqa: E402


def _image(seed: int, size=(64, 48)) -> Image.Image:
    import random
    rng = random.Random(seed)
    return Image.frombytes("RGB", size, bytes(rng.randrange(256)
                                               for _ in range(size[0] * size[1] * 3)))


def _png(image: Image.Image) -> bytes:
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def _data_url(image: Image.Image) -> str:
    return "data:image/png;base64," + base64.b64encode(_png(image)).decode()


def _chat(url: str, question: str = "What is in the picture?", images: int = 1) -> list[dict]:
    parts = [{"type": "image_url", "image_url": {"url": url}} for _ in range(images)]
    return [{"role": "user", "content": parts + [{"type": "text", "text": question}]}]


class _ImageSite:
    """An aiohttp server on a loopback port, in a thread: an image, a redirect, a 100 MB
    body, a PNG bomb."""

    def __init__(self, image: Image.Image) -> None:
        self.png = _png(image)
        self.redirect_to = ""
        self.port = 0
        self._ready = threading.Event()
        self._loop = asyncio.new_event_loop()
        threading.Thread(target=self._serve, daemon=True).start()
        self._ready.wait(10)

    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)
        app = web.Application()
        def body(data):
            async def handler(request):
                return web.Response(body=data() if callable(data) else data,
                                    content_type="image/png")
            return handler
        app.router.add_get("/img.png", body(lambda: self.png))
        app.router.add_get("/bomb.png", body(_bomb_png))
        app.router.add_get("/huge.png", body(lambda: b"\0" * (100 * 2**20)))

        async def redirect(request):
            raise web.HTTPFound(self.redirect_to)
        app.router.add_get("/redirect", redirect)

        async def start():
            runner = web.AppRunner(app)
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            self.port = site._server.sockets[0].getsockname()[1]
            self._ready.set()
        self._loop.run_until_complete(start())
        self._loop.run_forever()

    def url(self, path: str, host: str = "127.0.0.1") -> str:
        return f"http://{host}:{self.port}{path}"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return build_tiny_llava(str(tmp_path_factory.mktemp("tiny_llava_server")))


_ARGS = ["--dtype", "float32", "--device", "cpu", "--max-model-len", "256",
         "--max-num-seqs", "8"]


def _post(server: RemoteServer, messages: list[dict], **extra) -> httpx.Response:
    body = {"model": server.model, "messages": messages, "max_tokens": 8, "temperature": 0,
            **extra}
    return httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)


def _rendered(model_dir: str, messages: list[dict]) -> str:
    """The prompt text the server renders (image parts as the model's <image> token)."""
    from transformers import AutoTokenizer

    from folio.engine.chat import render_chat
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return render_chat(tokenizer, messages, image_placeholder="<image>").text


def test_openai_client_streams_a_base64_image_and_urls_are_fetched_safely(model_dir) -> None:
    picture = _image(5)
    site = _ImageSite(picture)
    with RemoteServer([model_dir, *_ARGS]) as server:
        server.model = model_dir
        client = server.client()
        messages = _chat(_data_url(picture))
        stream = client.chat.completions.create(
            model=model_dir, messages=messages, max_tokens=8, temperature=0, stream=True,
            stream_options={"include_usage": True})
        chunks = list(stream)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        usage = chunks[-1].usage
        # the same request whole: its tokens are transformers' greedy answer
        whole = _post(server, messages, return_token_ids=True).json()
        assert whole["choices"][0]["message"]["content"] == text
        prompt = _rendered(model_dir, messages)
        assert whole["choices"][0]["token_ids"] == hf_llava_greedy(model_dir, prompt,
                                                                   [picture], 8)
        # usage counts the image's tokens, not the one placeholder the template wrote
        assert usage.prompt_tokens == whole["usage"]["prompt_tokens"]
        assert usage.prompt_tokens == len(whole["prompt_token_ids"])
        from transformers import AutoConfig
        image_token = AutoConfig.from_pretrained(model_dir).image_token_index
        assert whole["prompt_token_ids"].count(image_token) == TOKENS_PER_IMAGE

        # the Anthropic client's base64 image block: the same answer
        import anthropic
        claude = anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0)
        b64 = base64.b64encode(_png(picture)).decode()
        reply = claude.messages.create(model=model_dir, max_tokens=8, extra_body={"temperature": 0}, messages=[
            {"role": "user", "content": [
                {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                             "data": b64}},
                {"type": "text", "text": "What is in the picture?"}]}])
        assert reply.content[0].text == text
        # (Anthropic counts the prefix-cache hit apart: the same image, the same blocks)
        assert reply.usage.input_tokens + reply.usage.cache_read_input_tokens \
            == usage.prompt_tokens

        # a loopback URL is refused by default, naming the reason
        refused = _post(server, _chat(site.url("/img.png")))
        assert refused.status_code == 400, refused.text
        error = refused.json()["error"]
        assert "private, loopback or reserved" in error["message"]
        assert error["type"] == "invalid_request_error" and error["param"] == "messages"
        # more images than --limit-mm-per-prompt allows (4 by default): 400 before fetching
        many = _post(server, _chat(site.url("/img.png"), images=5))
        assert many.status_code == 400 and "limit-mm-per-prompt" in many.json()["error"]["message"]
        # a file:// URL without --allowed-local-media-path
        local = _post(server, _chat("file:///etc/passwd"))
        assert local.status_code == 400 and "allowed-local-media-path" in local.text
        # a text-only request still runs, and the server is healthy
        assert _post(server, [{"role": "user", "content": "hello"}]).status_code == 200
        assert httpx.get(server.url + "/health").status_code == 200


def test_allowed_hosts_redirects_bounds_and_local_files(model_dir, tmp_path) -> None:
    picture = _image(9)
    site = _ImageSite(picture)
    media_dir = tmp_path / "media"
    media_dir.mkdir()
    (media_dir / "pic.png").write_bytes(_png(picture))
    (tmp_path / "outside.png").write_bytes(_png(picture))
    args = [model_dir, *_ARGS, "--allowed-media-domains", "127.0.0.1",
            "--allowed-local-media-path", str(media_dir),
            "--limit-mm-per-prompt", json.dumps({"image": 2})]
    with RemoteServer(args) as server:
        server.model = model_dir
        by_data = _post(server, _chat(_data_url(picture)))
        assert by_data.status_code == 200, by_data.text
        answer = by_data.json()["choices"][0]["message"]["content"]
        # the operator named the host: served, the same answer as the image sent inline
        by_url = _post(server, _chat(site.url("/img.png")))
        assert by_url.status_code == 200, by_url.text
        assert by_url.json()["choices"][0]["message"]["content"] == answer
        by_file = _post(server, _chat((media_dir / "pic.png").as_uri()))
        assert by_file.status_code == 200, by_file.text
        assert by_file.json()["choices"][0]["message"]["content"] == answer
        outside = _post(server, _chat((tmp_path / "outside.png").as_uri()))
        assert outside.status_code == 400 and "outside" in outside.json()["error"]["message"]
        # a redirect from the allowed host to another loopback name is refused
        site.redirect_to = site.url("/img.png", host="localhost")
        redirected = _post(server, _chat(site.url("/redirect")))
        assert redirected.status_code == 400, redirected.text
        assert "localhost" in redirected.json()["error"]["message"]
        # a 100 MB body and a 20,000 x 20,000 PNG bomb: refused for their size (the byte limit
        # stops the read, the pixel limit the decode: the message names which; no wall-clock
        # bound, which a loaded CI machine would break)
        for path, reason in (("/huge.png", "bytes"), ("/bomb.png", "pixels")):
            bounded = _post(server, _chat(site.url(path)))
            assert bounded.status_code == 400 and reason in bounded.json()["error"]["message"]
        # JPEG and WebP data URLs are decoded too
        for fmt, mime in (("JPEG", "image/jpeg"), ("WEBP", "image/webp")):
            out = io.BytesIO()
            picture.save(out, format=fmt)
            url = f"data:{mime};base64," + base64.b64encode(out.getvalue()).decode()
            assert _post(server, _chat(url)).status_code == 200, fmt
        # the limit from --limit-mm-per-prompt
        three = _post(server, _chat(_data_url(picture), images=3))
        assert three.status_code == 400 and "2 allowed" in three.json()["error"]["message"]
        two = _post(server, _chat(_data_url(picture), images=2))
        assert two.status_code == 200, two.text
        assert two.json()["usage"]["prompt_tokens"] > 2 * TOKENS_PER_IMAGE
        assert httpx.get(server.url + "/health").status_code == 200


def test_bench_serve_with_images_reports_ttft_with_and_without_the_encoder_cache(
        model_dir, tmp_path) -> None:
    """`folio bench serve --dataset random-mm` against the server: both passes complete, and
    the report carries TTFT without the encoder cache (first sight of each image) and with
    it (the same images, other texts)."""
    import argparse

    from folio.bench.serve import add_cli_args, run
    with RemoteServer([model_dir, *_ARGS]) as server:
        parser = argparse.ArgumentParser()
        add_cli_args(parser)
        out = tmp_path / "mm.json"
        args = parser.parse_args([
            "--base-url", server.url, "--endpoint", "/v1/chat/completions",
            "--dataset", "random-mm", "--num-prompts", "4", "--random-input-len", "8",
            "--random-output-len", "4", "--random-mm-image-size", "64x48",
            "--random-mm-images-per-request", "2", "--tokenizer", model_dir,
            "--disable-tqdm", "--quiet", "--output-json", str(out)])
        report = run(args)
        cache = report["encoder_cache"]
        assert report["completed"] == 4 and report["failed"] == 0, report["errors"]
        assert cache["without"]["completed"] == cache["with"]["completed"] == 4
        assert cache["with"]["median_ttft_ms"] > 0 and cache["without"]["median_ttft_ms"] > 0
        # each request's two images' tokens are counted in the server's usage
        assert cache["without"]["total_input_tokens"] > 4 * 2 * TOKENS_PER_IMAGE
        assert json.loads(out.read_text())["encoder_cache"]["images_per_request"] == 2
        bad = parser.parse_args(["--base-url", server.url, "--dataset", "random-mm",
                                 "--tokenizer", model_dir])
        with pytest.raises(ValueError, match="chat/completions"):
            run(bad)
