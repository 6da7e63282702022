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

from jinja2.exceptions import SecurityError, TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from msd_train.errors import ConfigError

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


class ChatTemplateError(ConfigError):
    """A chat template that Jinja (in its sandbox) cannot compile or render."""


def _template_error(e: Exception) -> ChatTemplateError:
    where = f" (line {e.lineno})" if getattr(e, "lineno", None) else ""
    unsafe = isinstance(e, SecurityError)
    return ChatTemplateError(
        f"the chat template (target.chat_template, or the target folder's chat_template.jinja / "
        f"tokenizer_config.json) cannot be {'rendered' if unsafe or not where else 'compiled'}{where}: "
        f"{type(e).__name__}: {e}"
        + ("; it reaches for Python internals, which the sandbox it runs in refuses (a template only formats "
           "messages)" if unsafe else "")
        + ". Fix the template, or set target.chat_template to a built-in one (vicuna_v1, chatml_qwen) or to "
          "the Jinja source of one that works")


class _Compiled:
    """A compiled template whose render errors are :class:`ChatTemplateError`."""

    def __init__(self, template: str):
        try:
            self.template = ImmutableSandboxedEnvironment(trim_blocks=False, lstrip_blocks=False).from_string(template)
        except TemplateError as e:
            raise _template_error(e) from None

    def render(self, **kw) -> str:
        try:
            return self.template.render(**kw)
        except TemplateError as e:
            raise _template_error(e) from None


@lru_cache(maxsize=16)
def _compiled(template: str) -> _Compiled:
    # Compiling is ~100x the cost of rendering; a dataset renders one template millions of times.
    return _Compiled(template)


# The Python twins of the templates below render one message at a time, ``(k, message,
# **special) -> text``: a prefix of a conversation renders as the sum of its messages' texts,
# plus the generation prompt. ``tests/unit/test_data_scale.py`` holds each to its Jinja source.
def _vicuna_v1_turn(k: int, m: dict, eos_token: str = "", **_) -> str:
    if m["role"] == "system":
        return m["content"]
    if m["role"] == "user":
        return (" USER: " if k == 0 else "USER: ") + m["content"] + " "
    return "ASSISTANT: " + m["content"] + eos_token


def _chatml_turn(system_prompt: str):
    """ChatML with a default system prompt when the conversation has none."""
    opening = f"<|im_start|>system\n{system_prompt}<|im_end|>\n"

    def turn(k: int, m: dict, **_) -> str:
        head = opening if k == 0 and m["role"] != "system" else ""
        return f"{head}<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n"

    return turn


# SmolLM2-Instruct's own template (the one ``conf/target/smollm2_llava.yaml``'s folder ships).
SMOLLM2_CHATML = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

#: template source -> (one message's text, the generation prompt): the same text as the Jinja
#: source renders, without a Jinja render per segment. A folder's template is matched by its
#: source, so a target shipping one of them gets it too.
_PYTHON_TEMPLATES = {
    VICUNA_V1: (_vicuna_v1_turn, "ASSISTANT:"),
    CHATML_QWEN: (_chatml_turn("You are a helpful assistant."), "<|im_start|>assistant\n"),
    SMOLLM2_CHATML: (_chatml_turn("You are a helpful AI assistant named SmolLM, trained by Hugging Face"),
                     "<|im_start|>assistant\n"),
}


def _render(template: str, messages: list[dict], add_generation_prompt: bool, **special) -> str:
    return _prefix_renderer(template, messages, special)(len(messages), add_generation_prompt)


def _prefix_renderer(template: str, messages: list[dict], special: dict):
    """``render(n, add_generation_prompt)``: the rendering of ``messages[:n]``. A template with
    a Python twin renders each message once (a prefix is a slice of the whole); any other is
    rendered by Jinja for each prefix asked for."""
    fast = _PYTHON_TEMPLATES.get(template)
    if fast is None:
        compiled = _compiled(template)
        return lambda n, gen: compiled.render(messages=messages[:n], add_generation_prompt=gen, **special)
    turn, generation = fast
    texts = [turn(k, m, **special) for k, m in enumerate(messages)]
    ends = [0]
    for t in texts:
        ends.append(ends[-1] + len(t))
    whole = "".join(texts)
    return lambda n, gen: whole[: ends[n]] + (generation if gen else "")


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
    render = _prefix_renderer(template, msgs, special)
    segments: list[Segment] = []
    done = ""
    for i, m in enumerate(msgs):
        if m["role"] == "assistant":
            head = render(i, True)
            if not head.startswith(done):
                raise ValueError("chat template does not render prefixes as prefixes")
            if head != done:
                segments.append(Segment(head[len(done):], False))
            done = head
            full = render(i + 1, False)
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
    tail = render(len(msgs), False)
    if tail != done and tail.startswith(done):
        segments.append(Segment(tail[len(done):], False))
    return segments


def render_prompt(messages: list[dict], template: str, image_text: str = IMAGE_MARKER, **special) -> str:
    """The text a target reads before generating the next assistant turn."""
    template = resolve_template(template)
    msgs = [{**m, "content": m["content"].replace(IMAGE_MARKER, image_text)} for m in messages]
    return _render(template, msgs, True, **special)
