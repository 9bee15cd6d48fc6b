"""Chat conversations to prompt text, through the model's (or a given) chat template."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from folio.multimodal.media_fetch import ImageRef as ChatImage

_ROLES = {"system", "user", "assistant", "tool", "developer"}
_IMAGE_PARTS = ("image_url", "image_pil")


@dataclass
class RenderedChat:
    """A conversation through its chat template: the prompt text, with one image
    placeholder where each image part was, and those images in order."""
    text: str
    images: list[ChatImage] = field(default_factory=list)


def _image_part(part: dict, index: int) -> ChatImage:
    where = f"messages[{index}].content {part['type']} part"
    if part["type"] == "image_pil":
        image = part.get("image_pil")
        if not (hasattr(image, "convert") and hasattr(image, "size")):
            raise ValueError(f"{where} needs a PIL image as 'image_pil'")
        return ChatImage(image=image)
    spec = part.get("image_url")
    url = spec.get("url") if isinstance(spec, dict) else spec
    if not isinstance(url, str) or not url:
        raise ValueError(f"{where} needs {{\"image_url\": {{\"url\": ...}}}}")
    return ChatImage(url=url)


def _normalise_content(content: Any, index: int, image_placeholder: str | None,
                       images: list[ChatImage]) -> Any:
    """The content as text; image parts (on a model that takes images: `image_placeholder`
    set) become the placeholder in the text and are appended to `images`."""
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or "type" not in part:
                raise ValueError(f"messages[{index}].content parts must be objects with a 'type'")
            if part["type"] == "text":
                if not isinstance(part.get("text"), str):
                    raise ValueError(f"messages[{index}].content text part needs a string 'text'")
                texts.append(part["text"])
            elif part["type"] in _IMAGE_PARTS and image_placeholder is not None:
                images.append(_image_part(part, index))
                texts.append(image_placeholder)
            elif part["type"] in _IMAGE_PARTS:
                raise ValueError(f"messages[{index}].content part type {part['type']!r} is not "
                                 "supported: this model takes text only")
            else:
                raise ValueError(f"messages[{index}].content part type {part['type']!r} is not "
                                 f"supported (text{', image_url' if image_placeholder else ''})")
        return "\n".join(texts)
    raise ValueError(f"messages[{index}].content must be a string or a list of parts")


def _normalise_tool_calls(tool_calls: Any, index: int) -> list[dict]:
    """OpenAI sends a call's arguments as JSON text; templates render them with tojson, so
    they get the parsed object (text that is not a JSON object is passed through as is)."""
    if not isinstance(tool_calls, list):
        raise ValueError(f"messages[{index}].tool_calls must be a list")
    out = []
    for j, call in enumerate(tool_calls):
        if not isinstance(call, dict):
            raise ValueError(f"messages[{index}].tool_calls[{j}] must be an object")
        call = dict(call)
        function = call.get("function")
        if isinstance(function, dict) and isinstance(function.get("arguments"), str):
            try:
                parsed = json.loads(function["arguments"])
            except ValueError:
                parsed = None
            if isinstance(parsed, dict):
                call["function"] = dict(function, arguments=parsed)
        out.append(call)
    return out


def normalise_messages(messages: Any, image_placeholder: str | None = None,
                       images: list[ChatImage] | None = None) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list of {role, content} objects")
    images = [] if images is None else images
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ValueError(f"messages[{i}] must be an object with 'role' and 'content'")
        role = message.get("role")
        if role not in _ROLES:
            raise ValueError(f"messages[{i}].role must be one of {sorted(_ROLES)}, got {role!r}")
        item = dict(message)
        item["content"] = _normalise_content(message.get("content"), i, image_placeholder,
                                             images)
        if item["content"] is None:
            # OpenAI clients send back an assistant tool-call turn with content null;
            # templates do string operations on content, so give them "".
            item["content"] = ""
        if message.get("tool_calls") is not None:
            item["tool_calls"] = _normalise_tool_calls(message["tool_calls"], i)
        if role == "developer":
            item["role"] = "system"  # templates know "system"; OpenAI's developer is the same
        out.append(item)
    return out


def render_chat(tokenizer: Any, messages: Any, *, chat_template: str | None = None,
                add_generation_prompt: bool = True, continue_final_message: bool = False,
                tools: list[dict] | None = None, chat_template_kwargs: dict | None = None,
                image_placeholder: str | None = None,
                max_images: int | None = None) -> RenderedChat:
    """The conversation's prompt text and its images. `image_placeholder`: the model's image
    token (None: a text model, image parts refused); `max_images`: the most image parts
    allowed (--limit-mm-per-prompt), checked before anything is fetched."""
    if add_generation_prompt and continue_final_message:
        raise ValueError("add_generation_prompt and continue_final_message cannot both be true")
    images: list[ChatImage] = []
    conversation = normalise_messages(messages, image_placeholder, images)
    if max_images is not None and len(images) > max_images:
        raise ValueError(f"messages hold {len(images)} images, more than the {max_images} "
                         "allowed per prompt (--limit-mm-per-prompt)")
    if continue_final_message and conversation[-1]["role"] != "assistant":
        raise ValueError("continue_final_message needs the last message to be from the assistant")
    template = chat_template or getattr(tokenizer, "chat_template", None)
    if not template:
        raise ValueError("this model's tokenizer has no chat template; pass chat_template")
    try:
        text = tokenizer.apply_chat_template(
            conversation, chat_template=template, tokenize=False,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message, tools=tools,
            **(chat_template_kwargs or {}))
    except Exception as exc:
        raise ValueError(f"the chat template failed on these messages: {exc}") from exc
    if image_placeholder is not None and text.count(image_placeholder) != len(images):
        # a template that drops or repeats content would misplace the images
        raise ValueError(f"the chat template rendered {text.count(image_placeholder)} image "
                         f"placeholders for {len(images)} images")
    return RenderedChat(text, images)


def apply_chat_template(tokenizer: Any, messages: Any, **kwargs: Any) -> str:
    """The conversation's prompt text (a text model's: image parts refused)."""
    return render_chat(tokenizer, messages, **kwargs).text
