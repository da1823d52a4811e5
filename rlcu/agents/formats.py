"""How tools, tool calls and their results are spelled in tokens.

`template` (the default) is the tokenizer's own chat template, as TRL uses it: `apply_chat_template(...,
tools=...)` renders the tools, and calls are read with the tokenizer's response parser where it has one
(`response_template` / `response_schema`), else by the `<tool_call>{json}</tool_call>` convention that
Qwen's and Hermes' templates use; a tokenizer of OpenAI's harmony format (gpt-oss: `<|channel|>`, `<|message|>`,
`<|call|>`) without a response parser has its turns read by `parse_harmony`. A template that cannot render a
tool-calling conversation is an error that names `hermes`, never a silent fallback.

`hermes` is rlcu's documented format for models whose template has no tool format (SmolLM2's ignores
`tools`): a system block lists the tools' JSON schemas between <tools> tags, the model calls one with
<tool_call>{"name": ..., "arguments": {...}}</tool_call>, and each result comes back in a user message
between <tool_response> tags. It needs only a template that renders system, user and assistant messages.

Tokens a turn adds are found as TRL finds them: the template renders a short conversation with and
without the new messages, and the difference, from just after the end-of-turn token, is appended."""
from __future__ import annotations

import json
import re

from rlcu.agents.tools import ToolCall

FORMATS = ("template", "hermes")
CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
HERMES_SYSTEM = (
    "You can call functions to help with the user's request. The functions, as JSON schemas:\n<tools>\n{tools}\n"
    "</tools>\nTo call a function, write a JSON object with its name and arguments between <tool_call> and "
    "</tool_call> tags, for example:\n<tool_call>\n{{\"name\": \"function_name\", \"arguments\": {{\"arg\": "
    "\"value\"}}}}\n</tool_call>\nEach result comes back between <tool_response> and </tool_response>.")
SENTINELS = ("tool_name_a8f3", "tool_arg_key_b9d4", "tool_arg_val_d6e7", "tool_content_c4f9")


def tool_format(name: str, tokenizer, template_kwargs: dict | None = None) -> "ToolFormat":
    """`template_kwargs`: extra arguments of the chat template for every render (TRL's chat_template_kwargs)."""
    if name not in FORMATS:
        raise ValueError(f"tool_format must be one of {FORMATS}, got {name!r}")
    return (TemplateFormat if name == "template" else HermesFormat)(tokenizer, template_kwargs)


def parse_tool_calls(text: str) -> tuple[str, list[ToolCall]]:
    """(content before the first call, the calls) of `<tool_call>{json}</tool_call>` blocks."""
    calls = []
    for block in CALL.findall(text):
        try:
            data = json.loads(block)
            name, arguments = data["name"], data.get("arguments") or {}
            if isinstance(arguments, str):
                arguments = json.loads(arguments)
            calls.append(ToolCall(str(name), arguments))
        except (ValueError, KeyError, TypeError) as e:
            calls.append(ToolCall("unknown", error=f"the tool call is not valid JSON with a name ({e})"))
    content = text.split("<tool_call>")[0].strip() if calls else text
    return content, calls


HARMONY_TOKENS = ("<|channel|>", "<|message|>", "<|call|>")  # what a tokenizer of the harmony format holds
HARMONY_END = re.compile(r"<\|(?:end|call|return)\|>")


def parse_harmony(text: str) -> tuple[dict, list[ToolCall]]:
    """An assistant turn in OpenAI's harmony format (gpt-oss), decoded with its special tokens: messages
    `<|channel|>CHANNEL to=functions.NAME <|constrain|>json<|message|>BODY<|call|>` one after another, each after
    `<|start|>assistant` (the recipient may come before the channel, as gpt-oss's template writes it). A message to
    `functions.NAME` calls NAME with BODY's JSON arguments; the analysis channel is the turn's reasoning (`thinking`,
    as the template names it); the final channel, and commentary to no one, its content."""
    content, thinking, calls = [], [], []
    for part in text.split("<|start|>"):
        if "<|message|>" not in part:
            continue
        head, body = part.split("<|message|>", 1)
        body = HARMONY_END.split(body, maxsplit=1)[0]
        channel = re.search(r"<\|channel\|>\s*(\w+)", head)
        recipient = re.search(r"\bto=functions\.([^\s<]+)", head)
        if recipient:
            calls.append(_harmony_call(recipient.group(1), body))
        elif channel is not None and channel.group(1) == "analysis":
            thinking.append(body)
        else:
            content.append(body)
    message = {"role": "assistant", "content": "".join(content)}
    if thinking:
        message["thinking"] = "".join(thinking)
    if calls:
        message["tool_calls"] = openai_calls(calls)
    return message, calls


def _harmony_call(name: str, body: str) -> ToolCall:
    try:
        arguments = json.loads(body) if body.strip() else {}
    except ValueError as e:
        return ToolCall(name, error=f"the arguments of the call are not valid JSON ({e})")
    if not isinstance(arguments, dict):
        return ToolCall(name, error=f"the arguments of the call are a JSON {type(arguments).__name__}, not an object")
    return ToolCall(name, arguments)


def openai_calls(calls: list[ToolCall]) -> list[dict]:
    return [{"type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in calls if c.error is None]


class ToolFormat:
    def __init__(self, tokenizer, template_kwargs: dict | None = None):
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("tools and environments need chat prompts, and the tokenizer has no chat template")
        self.tokenizer, self.template_kwargs = tokenizer, dict(template_kwargs or {})

    def render(self, messages: list[dict], tools: list[dict], add_generation_prompt: bool) -> str:
        raise NotImplementedError

    def ids(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def prompt_ids(self, messages: list[dict], tools: list[dict]) -> list[int]:
        return self.ids(self.render(messages, tools, add_generation_prompt=True))

    def parse(self, ids: list[int], prefix: list[int] | None = None) -> tuple[dict, list[ToolCall]]:
        """An assistant turn's tokens as a message (TRL's shape) and the tool calls in it; `prefix`: the tokens
        before the turn (its prompt), which a tokenizer's response template reads."""
        content, calls = parse_tool_calls(self.tokenizer.decode(ids, skip_special_tokens=True))
        message = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = openai_calls(calls)
        return message, calls

    def suffix_ids(self, new_messages: list[dict], tools: list[dict]) -> list[int]:
        """The tokens that follow an assistant turn's end-of-turn token when `new_messages` come next."""
        if new_messages[0]["role"] == "tool":
            call = {"type": "function", "function": {"name": new_messages[0].get("name", "tool"), "arguments": {}}}
            before = [{"role": "user", "content": "dummy"}, {"role": "assistant", "content": "", "tool_calls": [call]}]
        else:
            before = [{"role": "user", "content": "dummy"}, {"role": "assistant", "content": "dummy"}]
        prefix = self.ids(self.render(before, tools, add_generation_prompt=False))
        eos = self.tokenizer.eos_token_id
        ends = [i for i, t in enumerate(prefix) if t == eos]
        if ends:
            prefix = prefix[:ends[-1] + 1]
        full = self.ids(self.render(before + new_messages, tools, add_generation_prompt=True))
        if full[:len(prefix)] != prefix:
            raise ValueError("the chat template renders earlier messages differently once more follow; multi-turn "
                             "training needs a prefix-preserving template (or tool_format='hermes')")
        return full[len(prefix):]


class TemplateFormat(ToolFormat):
    def __init__(self, tokenizer, template_kwargs: dict | None = None):
        super().__init__(tokenizer, template_kwargs)
        self.checked = False
        vocab = tokenizer.get_vocab()
        self.harmony = all(t in vocab for t in HARMONY_TOKENS)

    def render(self, messages, tools, add_generation_prompt):
        if tools and not self.checked:
            self._check_renders_tools()
        return self.tokenizer.apply_chat_template(messages, tools=tools or None, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt, **self.template_kwargs)

    def _check_renders_tools(self) -> None:
        """TRL's test: a user -> assistant(tool call) -> tool conversation must show the call and the result."""
        name, key, value, content = SENTINELS
        call = {"type": "function", "function": {"name": name, "arguments": {key: value}}}
        messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "", "tool_calls": [call]},
                    {"role": "tool", "name": name, "content": content}]
        try:
            text = self.tokenizer.apply_chat_template(messages, tokenize=False)
        except Exception:  # noqa: BLE001 - jinja errors of every kind mean "cannot render it"
            text = ""
        if not all(s in text for s in SENTINELS):
            raise ValueError("the tokenizer's chat template cannot render tool calls and results; set "
                             "tool_format='hermes' (rlcu's tool format, docs/agents.md) or use a model whose "
                             "template supports tools")
        self.checked = True

    def parse(self, ids, prefix=None):
        tok = self.tokenizer
        template = getattr(tok, "response_template", None)
        if template is None and getattr(tok, "response_schema", None) is None:
            if self.harmony:
                return parse_harmony(tok.decode(ids, skip_special_tokens=False))
            return super().parse(ids)
        try:
            # a response template (transformers >= 5.13) reads the prompt before the turn; a legacy schema does not
            message = dict(tok.parse_response(ids, prefix=list(prefix or [])) if template is not None
                           else tok.parse_response(ids))
        except (ValueError, TypeError):  # a malformed call: the text, as TRL falls back
            return {"role": "assistant", "content": tok.decode(ids, skip_special_tokens=True)}, []
        message["content"] = (message.get("content") or "").removesuffix(tok.eos_token or "")
        calls = [ToolCall(c["function"]["name"], c["function"].get("arguments") or {})
                 for c in message.get("tool_calls") or [] if isinstance(c, dict) and "function" in c]
        return message, calls


class HermesFormat(ToolFormat):
    def render(self, messages, tools, add_generation_prompt):
        out = []
        for m in messages:
            if m["role"] == "tool":
                block = f"<tool_response>\n{m['content']}\n</tool_response>"
                if out and out[-1].get("tool_response"):  # results of one turn's calls share a user message
                    out[-1]["content"] += "\n" + block
                else:
                    out.append({"role": "user", "content": block, "tool_response": True})
            elif m["role"] == "assistant" and m.get("tool_calls"):
                calls = "\n".join(f"<tool_call>\n{json.dumps(c['function'])}\n</tool_call>" for c in m["tool_calls"])
                out.append({"role": "assistant", "content": (m.get("content") or "") + calls})
            else:
                out.append(dict(m))
        if tools:
            block = HERMES_SYSTEM.format(tools="\n".join(json.dumps(t) for t in tools))
            if out and out[0]["role"] == "system":
                out[0]["content"] = out[0]["content"] + "\n\n" + block
            else:
                out.insert(0, {"role": "system", "content": block})
        out = [{"role": m["role"], "content": m["content"]} for m in out]
        return self.tokenizer.apply_chat_template(out, tokenize=False, add_generation_prompt=add_generation_prompt,
                                                  **self.template_kwargs)
