"""Images through the official SDKs against `nebula serve` on the embedded demo model and its tiny vision tower
(models/nebula-demo-mmproj.gguf, scripts/make_demo_vision.py): a data-URL image in chat completions (OpenAI SDK),
an `input_image` in the Responses API, a base64 `image` block in the Messages API (Anthropic SDK). Each gets a 200
whose usage counts the image's tokens; a remote URL is a 400 that names the part. The image is one of the
committed test images (tests/fixtures/vision/images, made by scripts/make_vision_golden.py). Run with
scripts/test_sdk.sh.
"""

import base64
import json
import pathlib
import urllib.request

import anthropic
import openai
import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
PNG = (REPO / "tests/fixtures/vision/images/a_100x150.png").read_bytes()
DATA_URL = "data:image/png;base64," + base64.b64encode(PNG).decode()
MODEL = "nebula-demo"


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="none", max_retries=0, timeout=120)


def test_models_list_the_image_modality(server):
    with urllib.request.urlopen(f"{server}/v1/models") as resp:
        card = json.load(resp)["data"][0]
    assert "image" in card["input_modalities"]


def test_chat_completion_with_a_data_url_image(oai):
    resp = oai.chat.completions.create(
        model=MODEL,
        max_tokens=16,
        messages=[{"role": "user", "content": [
            {"type": "text", "text": "What is in this picture?"},
            {"type": "image_url", "image_url": {"url": DATA_URL}},
        ]}],
    )
    assert resp.choices[0].message.content or resp.choices[0].message.model_extra.get("reasoning_content")
    details = resp.usage.prompt_tokens_details.model_dump()
    # 100 x 150 at the demo tower's bounds (65,536 to 262,144 pixels, factor 32): resized to 224 x 320, 7 x 10 tokens.
    assert details["image_tokens"] == 70
    assert resp.usage.prompt_tokens > 70


def test_a_follow_up_turn_reuses_the_image_prefill(oai):
    messages = [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": DATA_URL}},
        {"type": "text", "text": "Describe it."},
    ]}]
    first = oai.chat.completions.create(model=MODEL, max_tokens=8, messages=messages)
    second = oai.chat.completions.create(model=MODEL, max_tokens=8, messages=messages)
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens_details.model_dump()["image_tokens"]


def test_responses_input_image(oai):
    resp = oai.responses.create(
        model=MODEL,
        max_output_tokens=16,
        input=[{"role": "user", "content": [
            {"type": "input_text", "text": "What is this?"},
            {"type": "input_image", "image_url": DATA_URL},
        ]}],
    )
    assert resp.status in ("completed", "incomplete")  # incomplete: the 16 tokens ran out while thinking
    assert resp.usage.input_tokens > 70


def test_remote_url_is_a_400_naming_the_part(oai):
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(
            model=MODEL,
            max_tokens=4,
            messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}]}],
        )
    assert e.value.body["param"] == "messages[0].content[0]"
    assert "network" in e.value.body["message"]


def test_anthropic_base64_image(server):
    client = anthropic.Anthropic(base_url=server, api_key="none", max_retries=0, timeout=120)
    msg = client.messages.create(
        model=MODEL,
        max_tokens=16,
        messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": base64.b64encode(PNG).decode()}},
            {"type": "text", "text": "What is in the image?"},
        ]}],
    )
    assert msg.stop_reason in ("end_turn", "max_tokens")
    assert msg.usage.input_tokens + (msg.usage.cache_read_input_tokens or 0) > 70
