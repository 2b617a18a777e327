"""Chat templates: a model's Jinja template rendered and tokenized as `transformers`' `apply_chat_template` does,
with the mask of the tokens an assistant wrote.

The environment is transformers' (`transformers/utils/chat_template_utils.py`): a sandboxed Jinja with
trim_blocks and lstrip_blocks, the loopcontrols extension, a `tojson` that does not escape HTML, the globals
`raise_exception` and `strftime_now`, and the `{% generation %}` tag marking the characters of assistant turns.
The rendered text is tokenized without adding special tokens (the template writes them; those it writes become
their ids), and a token is an assistant's when it overlaps a marked span (transformers'
`return_assistant_tokens_mask`).

Most templates as models ship them (Llama 3, Qwen2) have no `{% generation %}` tag. Their assistant spans are
found by rendering each assistant turn's conversation twice: up to the turn before it with the generation
prompt, and up to the turn itself; the characters between the two are the turn's content and what the template
writes after it (the end-of-turn token), less trailing whitespace (ChatML's newline after `<|im_end|>`), which
are the spans a `{% generation %}` tag around `content + end-of-turn` marks (as TRL's training templates do).
"""

from __future__ import annotations

import json
import re
from datetime import datetime
from pathlib import Path

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from jnntile.io import jsonfile

ROLES = ("system", "user", "assistant")
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
# tokenizer_config.json's special tokens, passed to templates by name (transformers' special_tokens_map).
SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")


class _AssistantTracker(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`: records the character span of its output in the text rendered so
    far (`spans` of the environment, a list the caller sets before rendering with `generate`)."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_track", [jinja2.nodes.ContextReference()]), [], [],
                                      body).set_lineno(lineno)

    def _track(self, context, caller):
        output = caller()
        tracking = context.environment.tracking
        if tracking is not None:
            blocks, spans = tracking
            start = sum(len(block) for block in blocks)
            spans.append((start, start + len(output)))
        return output


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format):
    return datetime.now().strftime(format)


class ChatTemplate:
    """A chat template (its Jinja source, `origin` naming where it came from) and the special tokens it is
    rendered with (tokenizer_config.json's: bos_token, eos_token, ...)."""

    def __init__(self, source: str, origin: str, special_tokens: dict[str, str] | None = None):
        self.source = source
        self.origin = origin
        self.special_tokens = dict(special_tokens or {})
        environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                    extensions=[_AssistantTracker, jinja2.ext.loopcontrols])
        environment.filters["tojson"] = _tojson
        environment.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now)
        environment.tracking = None
        try:
            self._template = environment.from_string(source)
        except jinja2.TemplateSyntaxError as error:
            raise ValueError(f"chat template {origin}: not a Jinja template (line {error.lineno}: {error.message}); "
                             "fix it or give another with --chat-template FILE") from None
        self.has_generation_tags = bool(_GENERATION_TAG.search(source))

    def _render(self, messages: list[dict], add_generation_prompt: bool) -> tuple[str, list[tuple[int, int]]]:
        """The text and the character spans its {% generation %} tags marked."""
        blocks, spans = [], []
        environment = self._template.environment
        environment.tracking = (blocks, spans)
        try:
            for block in self._template.generate(messages=messages, tools=None, documents=None,
                                                 add_generation_prompt=add_generation_prompt, **self.special_tokens):
                blocks.append(block)
        except jinja2.TemplateError as error:
            raise ValueError(f"chat template {self.origin} failed on this conversation: {error}") from None
        finally:
            environment.tracking = None
        return "".join(blocks), spans

    def render(self, messages: list[dict], add_generation_prompt: bool = False) -> tuple[str, list[tuple[int, int]]]:
        """The conversation's text and the character spans (start, end) of its assistant turns."""
        text, spans = self._render(messages, add_generation_prompt)
        if self.has_generation_tags:
            return text, spans
        spans = []
        for turn, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            before, _ = self._render(messages[:turn], add_generation_prompt=True)
            through, _ = self._render(messages[: turn + 1], add_generation_prompt=False)
            if not (through.startswith(before) and text.startswith(through)):
                raise ValueError(
                    f"chat template {self.origin} renders a conversation's turns differently once later turns "
                    "follow, so its assistant turns cannot be told apart; give a template that marks them with "
                    "{% generation %} ... {% endgeneration %} (--chat-template FILE)"
                )
            spans.append((len(before), len(through.rstrip())))
        return text, spans

    def encode(self, tokenizer: Tokenizer, messages: list[dict],
               add_generation_prompt: bool = False) -> tuple[list[int], list[int]]:
        """(ids, assistant mask) of the conversation, as apply_chat_template(tokenize=True,
        return_assistant_tokens_mask=True) gives them: a token is 1 when it overlaps an assistant span."""
        text, spans = self.render(messages, add_generation_prompt)
        encoding = tokenizer.encode(text, add_special_tokens=False)
        mask = [0] * len(encoding.ids)
        span = 0
        for index, (start, end) in enumerate(encoding.offsets):
            while span < len(spans) and start >= spans[span][1]:
                span += 1
            if span == len(spans):
                break
            if end > spans[span][0]:
                mask[index] = 1
        return list(encoding.ids), mask


def add_chat_template_flag(parser) -> None:
    """--chat-template FILE, of every command that renders conversations (python -m jnntile.data, generate --chat)."""
    parser.add_argument("--chat-template", metavar="FILE",
                        help="a Jinja chat template to render conversations with, instead of the model's or --tokenizer "
                             "directory's (chat_template.jinja, else tokenizer_config.json's chat_template)")


def _special_tokens(config: dict) -> dict[str, str]:
    tokens = {}
    for key in SPECIAL_TOKEN_KEYS:
        value = config.get(key)
        if isinstance(value, dict):  # {"content": "</s>", ...}
            value = value.get("content")
        if isinstance(value, str):
            tokens[key] = value
    return tokens


def _template_of_config(value, config_path: Path) -> str | None:
    """tokenizer_config.json's chat_template: a string, or a list of {"name", "template"} whose "default" one
    transformers uses."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {entry.get("name"): entry.get("template") for entry in value if isinstance(entry, dict)}
        if isinstance(named.get("default"), str):
            return named["default"]
    raise ValueError(f"{config_path}: chat_template is neither a template nor a list holding a 'default' one; "
                     "give a template with --chat-template FILE")


def load_chat_template(model_dir: str | Path, template_file: str | Path | None = None) -> ChatTemplate | None:
    """The chat template for a model directory's tokenizer: `template_file` (--chat-template) if given, else the
    directory's chat_template.jinja, else its tokenizer_config.json's chat_template (transformers' precedence);
    None when there is none. Its special tokens are always tokenizer_config.json's."""
    model_dir = Path(model_dir)
    config_path = model_dir / TOKENIZER_CONFIG_FILE
    config = {}
    if config_path.is_file():
        config = jsonfile.read_object(config_path, missing="a tokenizer's configuration",
                                      damaged="restore it from the model's files")
    if template_file is not None:
        path = Path(template_file)
        origin = f"--chat-template {path}"
    else:
        path = model_dir / CHAT_TEMPLATE_FILE
        origin = str(path)
    if template_file is not None or path.is_file():
        try:
            source = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as error:
            raise ValueError(f"{origin}: cannot read the chat template ({getattr(error, 'strerror', None) or error}); "
                             "give a UTF-8 Jinja file") from None
    else:
        source = _template_of_config(config.get("chat_template"), config_path)
        origin = f"{config_path} (chat_template)"
    if source is None:
        return None
    return ChatTemplate(source, origin, _special_tokens(config))
