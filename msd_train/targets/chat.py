"""Conversation -> prompt text, split into segments that do or do not carry the loss.

A conversation here is always the project's internal shape::

    {"id": "sample-7", "messages": [{"role": "user", "content": "<image>\\nWhat is this?"},
                                    {"role": "assistant", "content": "A red circle."}],
     "images": ["coco/1.jpg"]}

where every ``<image>`` marker in a message stands for the next image of ``images``.

Rendering is done with a chat template (Jinja, the transformers way). The loss mask is
derived by rendering growing prefixes of the conversation: the text an assistant turn
adds to the rendering is exactly what the model must learn to produce. That works for
any template that renders a prefix of a conversation as a prefix of its rendering, which
holds for Vicuna-v1, ChatML and the templates the supported targets ship.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from functools import lru_cache

from jinja2.sandbox import ImmutableSandboxedEnvironment

IMAGE_MARKER = "<image>"


def count_image_markers(texts_or_messages: Iterable[str | dict]) -> int:
    """How many images some turns stand for: the ``<image>`` markers in texts, or in the
    ``content`` of messages (a message whose content is not text counts none)."""
    n = 0
    for x in texts_or_messages:
        text = x.get("content") if isinstance(x, dict) else x
        n += text.count(IMAGE_MARKER) if isinstance(text, str) else 0
    return n

# Vicuna v1 as LLaVA-1.5 and MSD use it: an empty system prompt, " " after user turns,
# "</s>" closing each assistant turn (and taking the loss with it). Each image is rendered
# as the target's image placeholder followed by a newline, before the turn's text, as the
# llava-hf processors do.
VICUNA_V1 = (
    "{% for m in messages %}"
    "{% if m['role'] == 'system' %}{{ m['content'] }}"
    "{% elif m['role'] == 'user' %}"
    "{{ ' USER: ' if loop.first else 'USER: ' }}{{ m['content'] }} "
    "{% else %}ASSISTANT: {{ m['content'] }}{{ eos_token }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}ASSISTANT:{% endif %}"
)

# ChatML as Qwen2-VL / Qwen2.5-VL use it, with their default system prompt.
#: Qwen2-VL / Qwen2.5-VL's special tokens a ChatML image prompt uses (in the order the
#: offline tokenizers of random and tiny Qwen targets add them)
QWEN_SPECIALS = ["<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
CHATML_QWEN = (
    "{% for m in messages %}"
    "{% if loop.first and m['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

BUILTIN_TEMPLATES = {"vicuna_v1": VICUNA_V1, "chatml_qwen": CHATML_QWEN}


@dataclass(frozen=True)
class Segment:
    """A piece of rendered prompt text; ``loss`` is True for assistant output."""

    text: str
    loss: bool


def resolve_template(name_or_source: str) -> str:
    """A built-in template name (``vicuna_v1``, ``chatml_qwen``) or Jinja source."""
    return BUILTIN_TEMPLATES.get(name_or_source, name_or_source)


@lru_cache(maxsize=16)
def _compiled(template: str):
    # Compiling is ~100x the cost of rendering; a dataset renders one template millions of times.
    return ImmutableSandboxedEnvironment(trim_blocks=False, lstrip_blocks=False).from_string(template)


def _vicuna_v1(messages: list[dict], add_generation_prompt: bool, **special) -> str:
    eos = special.get("eos_token", "")
    out = []
    for k, m in enumerate(messages):
        if m["role"] == "system":
            out.append(m["content"])
        elif m["role"] == "user":
            out.append((" USER: " if k == 0 else "USER: ") + m["content"] + " ")
        else:
            out.append("ASSISTANT: " + m["content"] + eos)
    return "".join(out) + ("ASSISTANT:" if add_generation_prompt else "")


def _chatml_qwen(messages: list[dict], add_generation_prompt: bool, **special) -> str:
    out = []
    for k, m in enumerate(messages):
        if k == 0 and m["role"] != "system":
            out.append("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n")
        out.append(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n")
    return "".join(out) + ("<|im_start|>assistant\n" if add_generation_prompt else "")


#: the built-in templates written as Python: the same text as their Jinja source renders
#: (``tests/unit/test_data_scale.py`` holds them to it), without a Jinja render per segment.
#: A folder's template is matched by its source, so a target shipping one of them gets it too.
_PYTHON_TEMPLATES = {VICUNA_V1: _vicuna_v1, CHATML_QWEN: _chatml_qwen}


def _render(template: str, messages: list[dict], add_generation_prompt: bool, **special) -> str:
    fast = _PYTHON_TEMPLATES.get(template)
    if fast is not None:
        return fast(messages, add_generation_prompt, **special)
    return _compiled(template).render(
        messages=messages, add_generation_prompt=add_generation_prompt, **special
    )


def render_segments(
    messages: list[dict],
    template: str,
    image_text: str = IMAGE_MARKER,
    end_of_turn: str | None = None,
    **special: str,
) -> list[Segment]:
    """Render ``messages`` into consecutive segments; assistant turns carry the loss.

    ``image_text`` replaces each ``<image>`` marker (the target's placeholder, e.g.
    ``<|vision_start|><|image_pad|><|vision_end|>`` for Qwen2-VL). ``special`` are extra
    template variables such as ``eos_token``. With ``end_of_turn`` given, an assistant
    segment's loss stops right after that marker (ChatML's newline after ``<|im_end|>`` is
    never generated, so it carries no loss).
    """
    template = resolve_template(template)
    msgs = [{**m, "content": m["content"].replace(IMAGE_MARKER, image_text)} for m in messages]
    segments: list[Segment] = []
    done = ""
    for i, m in enumerate(msgs):
        if m["role"] == "assistant":
            head = _render(template, msgs[:i], True, **special)
            if not head.startswith(done):
                raise ValueError("chat template does not render prefixes as prefixes")
            if head != done:
                segments.append(Segment(head[len(done):], False))
            done = head
            full = _render(template, msgs[: i + 1], False, **special)
            if not full.startswith(done):
                raise ValueError(
                    "chat template renders the generation prompt differently from an "
                    "assistant turn; set target.chat_template to a template that does not"
                )
            turn = full[len(done):]
            cut = turn.rfind(end_of_turn) + len(end_of_turn) if end_of_turn and end_of_turn in turn else len(turn)
            segments.append(Segment(turn[:cut], True))
            if turn[cut:]:
                segments.append(Segment(turn[cut:], False))
            done = full
    tail = _render(template, msgs, False, **special)
    if tail != done and tail.startswith(done):
        segments.append(Segment(tail[len(done):], False))
    return segments


def render_prompt(messages: list[dict], template: str, image_text: str = IMAGE_MARKER, **special) -> str:
    """The text a target reads before generating the next assistant turn."""
    template = resolve_template(template)
    msgs = [{**m, "content": m["content"].replace(IMAGE_MARKER, image_text)} for m in messages]
    return _render(template, msgs, True, **special)
