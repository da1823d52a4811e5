"""The agent loop on a scripted tool-calling model and SmolLM2's real tokenizer: tool results come back as
tool messages, masks are right token for token, a result that overflows is rolled back, failures are
counted, and max_tool_calling_iterations bounds the rounds. The tools are written as TRL's docs write
them (a typed function with a Google-style docstring), not against rlcu."""
import asyncio
import time

import pytest
from transformers import AutoTokenizer

from rlcu.agents import AgentOptions, EpisodeRunner
from rlcu.contracts import SamplingParams
from tests.agents.scripted import ScriptedRollout, call


def multiply(a: int, b: int) -> int:
    """
    Multiplies two integers.

    Args:
        a: The first integer.
        b: The second integer.

    Returns:
        The product of the two integers.
    """
    return a * b


async def divide(a: int, b: int) -> float:
    """
    Divides two integers.

    Args:
        a: The dividend.
        b: The divisor.
    """
    await asyncio.sleep(0)
    return a / b


def sleepy(seconds: float) -> str:
    """
    Sleeps.

    Args:
        seconds: How long.
    """
    time.sleep(seconds)
    return "awake"


@pytest.fixture(scope="module")
def tokenizer(smollm2_folder):
    return AutoTokenizer.from_pretrained(smollm2_folder)


QUESTION = [{"role": "user", "content": "What is 123 * 456?"}]


def run(tokenizer, script, tools=(multiply,), rows=None, max_completion_length=200, **options):
    agent = AgentOptions.build(tokenizer, list(tools), tool_format_name="hermes",
                               max_completion_length=max_completion_length, **options)
    runner = EpisodeRunner(rows or [{"prompt": QUESTION}], agent)
    backend = ScriptedRollout(tokenizer, script)
    out = backend.generate(runner.prompt_ids, SamplingParams(max_tokens=max_completion_length, temperature=0),
                           runner)
    return runner, out, backend


def test_a_tool_call_and_its_result_token_for_token(tokenizer):
    def script(history, turn):
        return call("multiply", a=123, b=456) if turn == 0 else "It is 56088.<|im_end|>"

    runner, out, backend = run(tokenizer, script)
    assert "<tools>" in tokenizer.decode(runner.prompt_ids[0]) and '"name": "multiply"' in tokenizer.decode(
        runner.prompt_ids[0])
    messages = runner.completions[0]
    assert [m["role"] for m in messages] == ["assistant", "tool", "assistant"]
    assert messages[0]["tool_calls"] == [{"type": "function",
                                          "function": {"name": "multiply", "arguments": {"a": 123, "b": 456}}}]
    assert messages[1] == {"role": "tool", "name": "multiply", "content": "56088"}
    assert messages[2]["content"] == "It is 56088."
    first = tokenizer(call("multiply", a=123, b=456), add_special_tokens=False)["input_ids"]
    result = tokenizer("\n<|im_start|>user\n<tool_response>\n56088\n</tool_response><|im_end|>\n"
                       "<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
    last = tokenizer("It is 56088.<|im_end|>", add_special_tokens=False)["input_ids"]
    assert out.completion_ids[0] == first + result + last
    assert out.tool_mask[0] == [1] * len(first) + [0] * len(result) + [1] * len(last)
    assert out.logprobs[0] == [-0.5] * len(first) + [0.0] * len(result) + [-0.5] * len(last)
    # the second turn's request is the whole conversation, exactly as the chat template renders it
    rendered = runner.options.format.prompt_ids(QUESTION + messages[:2], runner.episodes[0].tools.schemas)
    assert backend.requests[1] == rendered
    assert runner.metrics() == {"tools/call_frequency": 1.0, "tools/failure_frequency": 0.0,
                                "episodes/mean_turns": 2.0}


def test_failures_unknown_tools_bad_json_async_and_timeouts(tokenizer):
    def script(history, turn):
        if turn == 0:
            return (call("multiply", a=1, b=2)[:-len("<|im_end|>")] + call("nope", x=1)[:-len("<|im_end|>")]
                    + "<tool_call>{not json}</tool_call>" + call("divide", a=1, b=0))
        if turn == 1:
            return call("divide", a=3, b=2)
        return call("sleepy", seconds=5) if turn == 2 else "done<|im_end|>"

    runner, out, _ = run(tokenizer, script, tools=(multiply, divide, sleepy), tool_timeout=0.3,
                         max_completion_length=800)
    tool = [m for m in runner.completions[0] if m["role"] == "tool"]
    assert tool[0]["content"] == "2"
    assert tool[1]["content"] == "{'error': 'Tool nope not found.'}"
    assert "not valid JSON" in tool[2]["content"] and "division by zero" in tool[3]["content"]
    assert tool[4]["content"] == "1.5"  # an async tool
    assert "timed out" in tool[5]["content"]
    metrics = runner.metrics()
    assert metrics["tools/call_frequency"] == 6 and metrics["tools/failure_frequency"] == pytest.approx(4 / 6)


def test_a_result_that_would_overflow_is_rolled_back(tokenizer):
    def script(history, turn):
        return call("multiply", a=123, b=456) if turn == 0 else "x<|im_end|>"

    first = len(tokenizer(call("multiply", a=123, b=456), add_special_tokens=False)["input_ids"])
    runner, out, _ = run(tokenizer, script, max_completion_length=first + 10)  # the result takes about 20
    assert out.finish_reasons == ["length"] and out.tool_mask == [[1] * first]
    assert [m["role"] for m in runner.completions[0]] == ["assistant"]  # the tool message was rolled back


def test_max_tool_calling_iterations_bounds_the_rounds(tokenizer):
    runner, out, _ = run(tokenizer, lambda history, turn: call("multiply", a=turn, b=2), max_tool_calling_iterations=2)
    assert runner.metrics()["tools/call_frequency"] == 2 and runner.metrics()["episodes/mean_turns"] == 3
    assert out.finish_reasons == ["stop"]


def test_tool_formats_never_fall_back_silently(tokenizer):
    with pytest.raises(ValueError, match="tool_format='hermes'"):
        AgentOptions.build(tokenizer, [multiply]).format.prompt_ids(QUESTION, [{"type": "function"}])
    with pytest.raises(ValueError, match="tool_format must be one of"):
        AgentOptions.build(tokenizer, [multiply], tool_format_name="json")


def test_a_tool_that_cannot_be_imported_is_a_one_line_error(tokenizer):
    with pytest.raises(ValueError, match="cannot import the tool 'nope.tools:fn'.*'my_pkg.tools:multiply'"):
        AgentOptions.build(tokenizer, ["nope.tools:fn"], tool_format_name="hermes")


def test_a_tool_without_a_docstring_is_an_error_at_set_up(tokenizer):
    def bare(a: int) -> int:
        return a

    with pytest.raises(ValueError, match="tool 'bare' cannot be described.*Google-style docstring"):
        AgentOptions.build(tokenizer, [bare], tool_format_name="hermes")


TOOL_TEMPLATE = (  # a prefix-preserving template that renders tools, calls and results (Qwen's shape, shortened)
    "{% if tools %}<|im_start|>system\nTools:{% for t in tools %}\n{{ t | tojson }}{% endfor %}<|im_end|>\n{% endif %}"
    "{% for m in messages %}{% if m.role == 'tool' %}<|im_start|>user\n<tool_response>{{ m.content }}</tool_response>"
    "<|im_end|>\n{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}{% for c in m.tool_calls or [] %}<tool_call>"
    "{{ c.function | tojson }}</tool_call>{% endfor %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_the_tokenizers_own_template_renders_tools_and_results(smollm2_folder):
    tok = AutoTokenizer.from_pretrained(smollm2_folder)
    tok.chat_template = TOOL_TEMPLATE
    agent = AgentOptions.build(tok, [multiply], tool_format_name="template", max_completion_length=200)
    runner = EpisodeRunner([{"prompt": QUESTION}], agent)
    assert tok.decode(runner.prompt_ids[0]).startswith('<|im_start|>system\nTools:{"type": "function"')
    script = lambda history, turn: call("multiply", a=2, b=3) if turn == 0 else "6<|im_end|>"  # noqa: E731
    out = ScriptedRollout(tok, script).generate(runner.prompt_ids, SamplingParams(max_tokens=200), runner)
    appended = [t for t, m in zip(out.completion_ids[0], out.tool_mask[0]) if m == 0]
    assert tok.decode(appended) == ("\n<|im_start|>user\n<tool_response>6</tool_response><|im_end|>\n"
                                    "<|im_start|>assistant\n")


def test_a_hung_tool_does_not_keep_a_stopping_run_waiting(tokenizer):
    from rlcu.calls import CallInterrupted

    agent = AgentOptions.build(tokenizer, [sleepy], tool_format_name="hermes", tool_timeout=None,
                               max_completion_length=200)
    runner = EpisodeRunner([{"prompt": QUESTION}], agent, stop_requested=lambda: True)
    backend = ScriptedRollout(tokenizer, lambda history, turn: call("sleepy", seconds=600))
    with pytest.raises(CallInterrupted, match="tool 'sleepy'"):
        backend.generate(runner.prompt_ids, SamplingParams(max_tokens=200), runner)


def test_a_tool_result_without_text_or_of_megabytes_is_contained():
    from rlcu.agents.tools import ToolBox, ToolCall

    class NoText:
        def __str__(self):
            raise RuntimeError("no")

    def broken() -> object:
        """Returns what has no text."""
        return NoText()

    def chatty() -> str:
        """Returns 60,000 characters."""
        return "x" * 60_000

    box = ToolBox([broken, chatty], max_result_chars=100)
    result, failed = box.run(ToolCall("broken", {}))
    assert failed and result == {"error": "the result of tool broken has no text (RuntimeError: no)"}
    result, failed = box.run(ToolCall("chatty", {}))
    assert not failed and result == "x" * 100 + " [... 59900 more characters cut]"


def spin(seconds: float) -> str:
    """
    Spins on the CPU, never giving up.

    Args:
        seconds: Ignored.
    """
    while True:
        pass


class Counter:
    def __init__(self):
        self.count = 0

    def reset(self, **kwargs):
        return None

    def bump(self) -> str:
        """Adds one to the count."""
        self.count += 1
        return str(self.count)


def test_tool_isolation_process_kills_a_busy_tool_and_keeps_an_environments_state(tokenizer):
    """A spinning tool past its timeout: in a thread (the default) it spins until the process ends; under
    tool_isolation=process its forked process is killed, so no core stays busy. An environment's methods still
    run here: their state is what the rewards read."""
    def script(history, turn):
        return [call("spin", seconds=1), call("multiply", a=2, b=3), call("bump"), "done<|im_end|>"][turn]

    agent = AgentOptions.build(tokenizer, [spin, multiply], environment_factory=Counter, tool_format_name="hermes",
                               max_completion_length=800, tool_timeout=0.5, tool_isolation="process")
    runner = EpisodeRunner([{"prompt": QUESTION}], agent)
    ScriptedRollout(tokenizer, script).generate(runner.prompt_ids, SamplingParams(max_tokens=800), runner)
    tool = [m["content"] for m in runner.completions[0] if m["role"] == "tool"]
    assert "timed out after 0.5 s (its process was killed)" in tool[0] and tool[1:] == ["6", "1"]
    assert runner.environments[0].count == 1
    start_cpu, start = time.process_time(), time.monotonic()
    time.sleep(1.0)
    assert time.process_time() - start_cpu < 0.5 * (time.monotonic() - start)  # nothing left spinning
