"""Chat templates (router/chat_template.py): the shipped tandem-shakespeare template renders as
transformers' own apply_chat_template does, the default is what docs/http-api.md says, and a
template cannot leave jinja2's sandbox."""

from __future__ import annotations

import json

import pytest

from engine.model_source import SHIPPED, SHAKESPEARE
from router.chat_template import DEFAULT_TEMPLATE, TemplateError, compile_template, load_chat_template

CONVERSATION = [{"role": "system", "content": "A street in Verona."},
                {"role": "user", "content": "Good morrow, cousin."},
                {"role": "assistant", "content": "Is the day so young?", "name": "Benvolio"},
                {"role": "user", "content": "But new struck nine."}]


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_shakespeare_template_equals_transformers(add_generation_prompt):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(SHIPPED[SHAKESPEARE]))
    want = hf.apply_chat_template(CONVERSATION, tokenize=False, add_generation_prompt=add_generation_prompt)
    ours = load_chat_template(SHIPPED[SHAKESPEARE])
    assert ours.render(CONVERSATION, add_generation_prompt) == want
    assert want.startswith("A street in Verona.\n\nROMEO:\nGood morrow, cousin.\n\nBENVOLIO:\n")
    assert want.endswith("JULIET:\n") == add_generation_prompt


def test_shakespeare_template_refuses_other_roles():
    with pytest.raises(TemplateError, match=r"role must be system \(or developer\), user or assistant"):
        load_chat_template(SHIPPED[SHAKESPEARE]).render([{"role": "tool", "content": "x"}])
    # newer OpenAI clients send a system prompt as "developer": a stage direction too
    t = load_chat_template(SHIPPED[SHAKESPEARE])
    assert t.render([{"role": "developer", "content": "Verona."}, {"role": "user", "content": "Hi"}]) == \
        t.render([{"role": "system", "content": "Verona."}, {"role": "user", "content": "Hi"}])


def test_a_chat_turn_ends_where_the_model_says(tmp_path):
    # tandem-shakespeare has no end-of-turn token: its generation_config.json ends a reply at a blank line
    assert load_chat_template(SHIPPED[SHAKESPEARE]).turn_end == ("\n\n",)
    assert load_chat_template(None).turn_end == ("\n\n",)  # the default template's turns are paragraphs
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ messages[0]['content'] }}"}))
    assert load_chat_template(tmp_path).turn_end == ()  # a chat model's template: its eos ends the turn
    (tmp_path / "generation_config.json").write_text(json.dumps({"stop_strings": "<end>"}))
    assert load_chat_template(tmp_path).turn_end == ("<end>",)
    (tmp_path / "generation_config.json").write_bytes(b"\xef\xbb\xbf" + json.dumps({"stop_strings": ["<e>"]}).encode())
    assert load_chat_template(tmp_path).turn_end == ("<e>",)  # a BOM is fine
    (tmp_path / "generation_config.json").write_text(json.dumps({"stop_strings": []}))
    assert load_chat_template(tmp_path).turn_end == ()  # explicitly none
    (tmp_path / "tokenizer_config.json").unlink()
    assert load_chat_template(tmp_path).turn_end == ()  # the default template too, when the file says none
    for bad in ([""], ["a"] * 5, [1], {"x": 1}):
        (tmp_path / "generation_config.json").write_text(json.dumps({"stop_strings": bad}))
        with pytest.raises(ValueError, match="generation_config.json: stop_strings must be"):
            load_chat_template(tmp_path)
    for raw in (b"[1]", b"\xff\xfe{}"):
        (tmp_path / "generation_config.json").write_bytes(raw)
        with pytest.raises(ValueError, match="generation_config.json: not a JSON object in UTF-8"):
            load_chat_template(tmp_path)


def test_default_template_for_a_model_without_one(tmp_path):
    for folder in (None, tmp_path):  # tandem-tiny; a folder without tokenizer_config.json
        t = load_chat_template(folder)
        assert t.source == "default"
        assert t.render([{"role": "user", "content": "hi"}]) == "user: hi\n\nassistant:"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    assert load_chat_template(tmp_path).template.render(messages=[], add_generation_prompt=True) == "assistant:"
    assert compile_template(DEFAULT_TEMPLATE, "x").render([], add_generation_prompt=False) == ""


def test_named_templates_and_special_tokens(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": {"content": "<s>"}, "eos_token": "</s>",
        "chat_template": [{"name": "tool_use", "template": "no"},
                          {"name": "default", "template": "{{ bos_token }}{% for m in messages %}{{ m.content }}"
                                                          "{{ eos_token }}{% endfor %}"}]}))
    assert load_chat_template(tmp_path).render([{"role": "user", "content": "a"}]) == "<s>a</s>"


def test_template_cannot_escape_the_sandbox():
    t = compile_template("{{ ''.__class__.__mro__[1].__subclasses__() }}", "evil")
    with pytest.raises(TemplateError):
        t.render([])
    t = compile_template("{% set _ = messages.append(1) %}", "mutating")
    with pytest.raises(TemplateError):  # the immutable sandbox: no changing the request's messages
        t.render([])


def test_bad_template_files_name_the_file(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text("{")
    with pytest.raises(ValueError, match="tokenizer_config.json: not JSON"):
        load_chat_template(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{% for %}"}))
    with pytest.raises(ValueError, match="not valid Jinja2"):
        load_chat_template(tmp_path)


def test_a_role_the_template_refuses_is_named_by_its_index():
    """The shipped template's "... got tool" names the first message of that role
    (messages[1].role), not the whole list; a refusal naming no role stays `messages`."""
    from router.http_api import _template_param
    from router.openai_protocol import ChatCompletionRequest
    req = ChatCompletionRequest(messages=[{"role": "user", "content": "Hi"}, {"role": "tool", "content": "x"}])
    with pytest.raises(TemplateError) as exc:
        load_chat_template(SHIPPED[SHAKESPEARE]).render(req.template_messages())
    assert _template_param(req.messages, str(exc.value)) == "messages[1].role"
    assert _template_param(req.messages, "roles must alternate") == "messages"
    assert _template_param(req.messages, "got nobody") == "messages"
