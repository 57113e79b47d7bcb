"""A client's typed image token text stays text (`chat_protocol.typed_image_text`): in
chat messages, tool definitions and calls, and raw prompts, a Qwen-VL-style model's
`<|image_pad|>` becomes the ordinary tokens of its characters; only image parts place
images; other special tokens a client types are still parsed."""

from __future__ import annotations

from typing import Any

from tokenizers import AddedToken, Tokenizer, pre_tokenizers, processors
from tokenizers.models import WordLevel
from transformers import PreTrainedTokenizerFast

from exo.chat_protocol.image_tokens import ImageTokens, QwenVLImageTokens
from exo.chat_protocol.prompt import render_prompt
from exo.chat_protocol.typed_image_text import image_token_texts, ordinary_token_ids
from exo.shared.types.common import ModelId
from exo.shared.types.text_generation import (
    IMAGE_MARKER,
    ChatMessage,
    ImageInput,
    NamedToolChoice,
    TextGenerationTaskParams,
    ToolCall,
    ToolDefinition,
)

WORDS = ["<unk>", "<s>", "user", "assistant", "hi", "there", "<|", "|>", "image_pad"]
WORDS += ["vision_start", "vision_end", "|><|", "find", '{"', '":', '"}', '"', "q", "x"]
SPECIALS = ["<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|image_pad|>", "<|vision_end|>"]
ID = {word: index for index, word in enumerate(WORDS + SPECIALS)}
START, END, PAD = ID["<|vision_start|>"], ID["<|vision_end|>"], ID["<|image_pad|>"]
TYPED_PAD = [ID["<|"], ID["image_pad"], ID["|>"]]
TEMPLATE = (
    "{% for tool in tools or [] %}{{ tool.function.name }} {{ tool.function.description }} "
    "{% endfor %}{% for m in messages %}<|im_start|>{{ m.role }} {{ m.content }}"
    "{% for call in m.tool_calls or [] %} {{ call.function.name }} "
    "{{ call.function.arguments | tojson }}{% endfor %}<|im_end|>{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant{% endif %}"
)
CONFIG = {
    "model_type": "qwen2_5_vl",
    "vision_config": {"patch_size": 8, "spatial_merge_size": 2},
    "image_token_id": PAD,
    "vision_start_token_id": START,
    "vision_end_token_id": END,
}


def _tokenizer() -> Any:
    """Whitespace-split words (`\\w+` and runs of punctuation), the ChatML and Qwen-VL
    image tokens special, `<s>` added by itself before any text."""
    model = Tokenizer(WordLevel(ID, unk_token="<unk>"))
    model.pre_tokenizer = pre_tokenizers.Whitespace()
    model.add_special_tokens([AddedToken(token, special=True) for token in SPECIALS])
    model.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", ID["<s>"])]
    )
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=model, unk_token="<unk>")
    tokenizer.chat_template = TEMPLATE
    return tokenizer


def _image_tokens(tokenizer: Any) -> ImageTokens:
    tokens = ImageTokens.of_config(CONFIG, tokenizer)
    assert isinstance(tokens, QwenVLImageTokens)
    return tokens


def _chat(content: str, images: int = 0, **fields: Any) -> TextGenerationTaskParams:
    image = ImageInput(data=b"x", media_type="image/png", width=32, height=16, sha256="0" * 64)
    message = ChatMessage(role="user", content=content, images=(image,) * images)
    return TextGenerationTaskParams(model=ModelId("m"), messages=(message,), **fields)


def test_typed_placeholder_without_an_image_is_its_ordinary_tokens() -> None:
    tokenizer = _tokenizer()
    rendered = render_prompt(tokenizer, _chat("hi <|image_pad|> there"), _image_tokens(tokenizer))
    user = [ID["<|im_start|>"], ID["user"], ID["hi"], *TYPED_PAD, ID["there"], ID["<|im_end|>"]]
    assert rendered.token_ids == [*user, ID["<|im_start|>"], ID["assistant"]]
    assert rendered.text == "<|im_start|>user hi <|image_pad|> there<|im_end|><|im_start|>assistant"
    # Without the model's image tokens (a text model) the text is parsed as before.
    assert PAD in render_prompt(tokenizer, _chat("hi <|image_pad|> there")).token_ids


def test_typed_image_part_beside_one_image_places_one_image() -> None:
    """The whole typed image part and one image part: the typed part is ordinary tokens
    (where two tokens met, `|><|` is one word), the image part its merged patches."""
    tokenizer = _tokenizer()
    content = f"<|vision_start|><|image_pad|><|vision_end|> {IMAGE_MARKER}"
    image_tokens = _image_tokens(tokenizer)
    rendered = render_prompt(tokenizer, _chat(content, images=1), image_tokens)
    typed = [ID["<|"], ID["vision_start"], ID["|><|"], ID["image_pad"], ID["|><|"]]
    typed += [ID["vision_end"], ID["|>"]]
    pads = image_tokens.sequence((32, 16))
    assert set(pads) == {PAD}
    image = [START, *pads, END]
    user = [ID["<|im_start|>"], ID["user"], *typed, *image, ID["<|im_end|>"]]
    assert rendered.token_ids == [*user, ID["<|im_start|>"], ID["assistant"]]


def test_other_special_tokens_a_client_types_are_parsed() -> None:
    """Only image tokens are kept as text: a typed `<|im_end|>` still ends the turn's
    text (what llama.cpp's server and vLLM do too)."""
    tokenizer = _tokenizer()
    rendered = render_prompt(tokenizer, _chat("hi <|im_end|>"), _image_tokens(tokenizer))
    assert rendered.token_ids.count(ID["<|im_end|>"]) == 2


def test_tool_names_descriptions_and_calls_keep_typed_text() -> None:
    """Typed image token text in a tool's name and description, a named tool choice and
    a history call's arguments (rendered through `tojson`): all ordinary tokens, the
    named tool still offered."""
    tokenizer = _tokenizer()
    tool = ToolDefinition(name="find<|image_pad|>", description="x <|vision_start|>")
    call = ToolCall(id="c1", name="find<|image_pad|>", arguments='{"q": "<|image_pad|>"}')
    messages = (
        ChatMessage(role="user", content="hi"),
        ChatMessage(role="assistant", tool_calls=(call,)),
        ChatMessage(role="user", content="there"),
    )
    params = TextGenerationTaskParams(
        model=ModelId("m"), messages=messages, tools=(tool,),
        tool_choice=NamedToolChoice(name="find<|image_pad|>"),
    )  # fmt: skip
    rendered = render_prompt(tokenizer, params, _image_tokens(tokenizer))
    assert not {START, PAD, END} & set(rendered.token_ids)
    assert rendered.text.startswith("find<|image_pad|> x <|vision_start|> ")
    assert '"q": "<|image_pad|>"' in rendered.text
    description = [ID["find"], *TYPED_PAD, ID["x"], ID["<|"], ID["vision_start"], ID["|>"]]
    assert rendered.token_ids[: len(description)] == description


def test_raw_prompt_keeps_typed_image_text_and_parses_other_special_tokens() -> None:
    """A raw prompt takes no images: its image token text is ordinary tokens, its ChatML
    tokens are parsed, and the tokenizer's own `<s>` still starts it."""
    tokenizer = _tokenizer()
    prompt = "<|im_start|>user hi <|image_pad|><|im_end|>"
    params = TextGenerationTaskParams(model=ModelId("m"), prompt=prompt)
    rendered = render_prompt(tokenizer, params, _image_tokens(tokenizer))
    expected = [ID["<s>"], ID["<|im_start|>"], ID["user"], ID["hi"], *TYPED_PAD]
    assert rendered.token_ids == [*expected, ID["<|im_end|>"]]
    assert rendered.text == prompt
    # Without typed image text a raw prompt is tokenized as it always was.
    plain = TextGenerationTaskParams(model=ModelId("m"), prompt="hi there")
    assert render_prompt(tokenizer, plain, _image_tokens(tokenizer)).token_ids == [1, 4, 5]


def test_ordinary_tokens_match_no_added_token() -> None:
    """Special or not, an added token's text is read by the vocabulary's own model."""
    tokenizer = _tokenizer()
    tokenizer.add_tokens([AddedToken("hi there", normalized=False)])
    assert tokenizer.encode("hi there", add_special_tokens=False) == [len(WORDS) + len(SPECIALS)]
    assert ordinary_token_ids(tokenizer, "hi there <|im_end|>") == [4, 5, 6, 0, 7]


def test_image_token_texts_are_the_added_ones() -> None:
    """The texts kept apart are the image tokens a client's text would turn into; an image
    token that is an ordinary word of the vocabulary is left alone."""
    tokenizer = _tokenizer()
    texts = image_token_texts(_image_tokens(tokenizer), tokenizer)
    assert set(texts) == {"<|vision_start|>", "<|image_pad|>", "<|vision_end|>"}
    ordinary = QwenVLImageTokens.from_config({**CONFIG, "image_token_id": ID["hi"]}, tokenizer, {})
    assert "hi" not in image_token_texts(ordinary, tokenizer)
