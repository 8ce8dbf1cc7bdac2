"""Chat templates: a list of messages → one prompt string, as transformers' `apply_chat_template` does.

The template is the checkpoint's `tokenizer_config.json` `chat_template` (a Jinja2 string, or
a list of named templates of which "default" is used), rendered in jinja2's
`ImmutableSandboxedEnvironment` with `trim_blocks` and `lstrip_blocks`, the `loopcontrols`
extension, and the globals transformers gives: `messages`, `add_generation_prompt`,
`bos_token`, `eos_token`, `raise_exception(msg)` and `strftime_now(fmt)`. A template cannot
read attributes outside the sandbox, and a template error is the request's fault (400).

A checkpoint without one (tandem-tiny, or a folder without `chat_template`) gets
DEFAULT_TEMPLATE: one `<role>: <content>` paragraph per message, then `assistant:` when a
generation prompt is asked for.

A chat reply ends at the end of its turn. Chat models mark it with an end-of-turn token (their
eos); a model trained on plain text (tandem-shakespeare) has none, and would go on to write the
other speakers' turns. For those the turn's end is a stop string (`ChatTemplate.turn_end`): the
checkpoint's `generation_config.json` `stop_strings` (transformers' GenerationConfig field)
where it has them, and a blank line for DEFAULT_TEMPLATE, whose turns are paragraphs.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from common.validation import MAX_STOP_CHARS

# Documented in docs/http-api.md ("Chat templates"); keep them in step.
DEFAULT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


class TemplateError(ValueError):
    """The messages could not be rendered (the template raised, or is not valid Jinja2)."""


def _raise_exception(message: str):
    raise TemplateError(message)


DEFAULT_TURN_END = ("\n\n",)  # DEFAULT_TEMPLATE's turns are paragraphs
MAX_TURN_END = 4  # stop strings a checkpoint may give (the request's own share the 16 per request)


@dataclass(frozen=True)
class ChatTemplate:
    """One compiled template with the tokens it may refer to.

    source is where it came from: a tokenizer_config.json path, or "default".
    """

    template: jinja2.Template
    source: str
    bos_token: str = ""
    eos_token: str = ""
    turn_end: tuple[str, ...] = ()  # stop strings that end a chat reply (see the module docstring)

    def render(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """The prompt for `messages` (each a dict with at least `role` and `content`).

        Raises:
            TemplateError: the template raised (e.g. `raise_exception("roles must alternate")`)
                or failed while rendering.
        """
        try:
            return self.template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                        bos_token=self.bos_token, eos_token=self.eos_token)
        except TemplateError:
            raise
        except jinja2.TemplateError as exc:
            raise TemplateError(f"chat template failed: {exc}") from None


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: time.strftime(fmt)
    return env


def _token_text(value) -> str:
    """tokenizer_config.json writes special tokens as a string or as {"content": ...}."""
    if isinstance(value, dict):
        return str(value.get("content", ""))
    return value if isinstance(value, str) else ""


def compile_template(source: str, name: str, bos_token: str = "", eos_token: str = "",
                     turn_end: tuple[str, ...] = ()) -> ChatTemplate:
    """Compile `source`.

    Raises:
        ValueError: not valid Jinja2 (naming `name`).
    """
    try:
        template = _environment().from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise ValueError(f"{name}: chat_template is not valid Jinja2: {exc}") from None
    return ChatTemplate(template, name, bos_token, eos_token, turn_end)


def load_turn_end(checkpoint_dir: Path | None) -> tuple[str, ...] | None:
    """`stop_strings` of checkpoint_dir/generation_config.json (a string or a list of strings; an
    empty list: none), or None where neither the file nor the field is there.

    Raises:
        ValueError: the file is not UTF-8 JSON, or stop_strings is not 0 to MAX_TURN_END non-empty
            strings of at most 256 characters (naming the file).
    """
    path = Path(checkpoint_dir) / "generation_config.json" if checkpoint_dir is not None else None
    if path is None or not path.exists():
        return None
    try:
        value = json.loads(path.read_text(encoding="utf-8-sig")).get("stop_strings")  # (a BOM is allowed)
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as exc:
        raise ValueError(f"{path}: not a JSON object in UTF-8: {exc}") from None
    if value is None:
        return None
    stops = [value] if isinstance(value, str) else value
    if not (isinstance(stops, list) and len(stops) <= MAX_TURN_END
            and all(isinstance(x, str) and 0 < len(x) <= MAX_STOP_CHARS for x in stops)):
        raise ValueError(f"{path}: stop_strings must be a string or a list of at most {MAX_TURN_END} non-empty "
                         f"strings of at most {MAX_STOP_CHARS} characters")
    return tuple(dict.fromkeys(stops))


def load_chat_template(checkpoint_dir: Path | None) -> ChatTemplate:
    """The template of `checkpoint_dir/tokenizer_config.json`, or DEFAULT_TEMPLATE without one.

    Raises:
        ValueError: the file is not JSON, or its chat_template is neither a string nor a list
            of {"name", "template"}, or not valid Jinja2; or generation_config.json's
            stop_strings are unusable (`load_turn_end`).
    """
    turn_end = load_turn_end(checkpoint_dir)
    default_template = compile_template(DEFAULT_TEMPLATE, "default",
                                        turn_end=DEFAULT_TURN_END if turn_end is None else turn_end)
    path = Path(checkpoint_dir) / "tokenizer_config.json" if checkpoint_dir is not None else None
    if path is None or not path.exists():
        return default_template
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not JSON: {exc}") from None
    source = config.get("chat_template")
    if isinstance(source, list):  # transformers: several named templates; "default" is the chat one
        named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
        source = named.get("default")
    if source is None:
        return default_template
    if not isinstance(source, str):
        raise ValueError(f"{path}: chat_template must be a string or a list of {{name, template}}")
    return compile_template(source, str(path), _token_text(config.get("bos_token")),
                            _token_text(config.get("eos_token")), turn_end or ())
