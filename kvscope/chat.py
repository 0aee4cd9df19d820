"""Chat conversations as prompts, for ``LLM.chat``: each is rendered by a chat template.

As in vLLM, the template renders a conversation to text with the special tokens it wants, and
the text is tokenized without adding any more: the model sees exactly the template's tokens.
Message content may be a string or OpenAI-style parts; text parts are joined with newlines
(vLLM's "string" content format). kvscope's models read text only, so any other part is
refused by name.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from kvscope.arg_checks import check_text

Conversation = list[dict[str, Any]]
# apply_chat_template's arguments that chat() sets itself, and what it does with them
_CHAT_SETS = {"tokenize": "renders the text and tokenizes it itself",
              "conversation": "renders the messages it is given"}


def as_conversations(messages: Any) -> list[Conversation]:
    """``messages``, one conversation (a list of message dicts) or a list of them, as a list
    of checked conversations whose contents are strings."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError(f"messages must be a non-empty list of message dicts, or a list of such "
                         f"lists (one per conversation), got {_shown(messages)}")
    if all(isinstance(m, (list, tuple)) for m in messages):
        return [_conversation(c, f"messages[{i}]") for i, c in enumerate(messages)]
    return [_conversation(messages, "messages")]


def _conversation(messages: Sequence[Any], name: str) -> Conversation:
    if not messages:
        raise ValueError(f"{name} is an empty conversation; give it at least one message")
    return [_message(m, f"{name}[{i}]") for i, m in enumerate(messages)]


def _message(message: Any, name: str) -> dict[str, Any]:
    if not isinstance(message, Mapping):
        raise TypeError(f"{name} must be a message dict with 'role' and 'content', got {_shown(message)} "
                        "(a list of conversations must hold lists only)")
    role = message.get("role")
    if not isinstance(role, str) or not role:
        raise ValueError(f"{name}['role'] must be a non-empty str such as 'user', got {role!r}")
    check_text(f"{name}['role']", role)
    return {**message, "content": _content(message.get("content"), f"{name}['content']")}


def _content(content: Any, name: str) -> str | None:
    """A message's content as the template reads it: a str, or None (an assistant turn that
    only calls tools)."""
    if content is None:
        return content
    if isinstance(content, str):
        check_text(name, content)
        return content
    if not isinstance(content, (list, tuple)):
        raise TypeError(f"{name} must be a str or a list of {{'type': 'text', 'text': ...}} parts, "
                        f"got {_shown(content)}")
    texts = []
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, Mapping) else None
        if kind != "text" or not isinstance(part.get("text"), str):
            raise ValueError(f"{name}[{i}] must be a {{'type': 'text', 'text': str}} part (kvscope's "
                             f"models read text only), got {_shown(part)}")
        check_text(f"{name}[{i}]['text']", part["text"])
        texts.append(part["text"])
    return "\n".join(texts)


def render(tokenizer: Any, conversation: Conversation, options: dict[str, Any]) -> str:
    """The prompt text the chat template makes of ``conversation`` (``options``: from
    :func:`template_options`)."""
    try:
        text = tokenizer.apply_chat_template(conversation, **options, tokenize=False)
    except Exception as exc:  # (a template's own error, or Python's out of its code or of a kwarg's value)
        raise ValueError(f"the chat template failed on this conversation: {exc}") from exc
    if not isinstance(text, str):
        raise TypeError(f"the tokenizer's apply_chat_template returned {type(text).__name__}, not the "
                        "prompt text")
    check_text("the chat template's rendering of messages", text)  # (a value in chat_template_kwargs, say)
    return text


def template_options(tokenizer: Any, chat_template: str | None, add_generation_prompt: bool,
                     continue_final_message: bool, tools: list[dict[str, Any]] | None,
                     chat_template_kwargs: Any) -> dict[str, Any]:
    """The keywords every conversation is rendered with, checked before any is rendered;
    ``chat_template_kwargs`` go to the template and override the named options, as in vLLM."""
    if chat_template_kwargs is not None and (
            not isinstance(chat_template_kwargs, Mapping) or not all(isinstance(k, str) for k in chat_template_kwargs)):
        raise TypeError(f"chat_template_kwargs must be a dict with str keys, got {_shown(chat_template_kwargs)}")
    taken = next((key for key in _CHAT_SETS if key in (chat_template_kwargs or {})), None)
    if taken is not None:
        raise ValueError(f"chat_template_kwargs may not set {taken!r}: chat() {_CHAT_SETS[taken]}")
    options = {"chat_template": chat_template, "add_generation_prompt": add_generation_prompt,
               "continue_final_message": continue_final_message, "tools": tools,
               **(chat_template_kwargs or {})}
    for name in ("add_generation_prompt", "continue_final_message"):
        if not isinstance(options[name], bool):
            raise TypeError(f"{name} must be a bool, got {_shown(options[name])}")
    if options["add_generation_prompt"] and options["continue_final_message"]:
        raise ValueError("continue_final_message=True continues the last message, so it needs "
                         "add_generation_prompt=False")
    template = options["chat_template"]
    if template is not None and (not isinstance(template, str) or not template):
        raise ValueError(f"chat_template must be a non-empty Jinja template string, got {_shown(template)}")
    if template is not None:
        check_text("chat_template", template)
    if template is None and not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model's tokenizer has no chat template (tokenizer_config.json has no "
                         "'chat_template'); pass chat_template=<a Jinja template string>, or use "
                         "generate() with a prompt")
    if options["tools"] is not None and not (
            isinstance(options["tools"], (list, tuple)) and all(isinstance(t, Mapping) for t in options["tools"])):
        raise TypeError(f"tools must be a list of tool dicts, got {_shown(options['tools'])}")
    return options


def _shown(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}… ({type(value).__name__})"
