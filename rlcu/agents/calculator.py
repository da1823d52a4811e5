"""A calculator tool, written as TRL's docs write tools (a typed function with a Google-style docstring):
the calculator recipe gives it to a model that cannot multiply 3-digit numbers in its head. It evaluates
on the syntax tree (the countdown reward's evaluator), never with eval()."""
from __future__ import annotations

from rlcu.rewards.countdown import evaluate


def calculator(expression: str) -> str:
    """
    Evaluates an arithmetic expression with integers, + - * / and parentheses.

    Args:
        expression: The expression to evaluate, for example "123 * 456".

    Returns:
        The value of the expression.
    """
    found = evaluate(str(expression))
    if found is None:
        raise ValueError(f"cannot evaluate {expression!r}: use integers, + - * / and parentheses")
    value = found[0]
    return str(value.numerator) if value.denominator == 1 else f"{float(value):.6g}"


# The calculator as an OpenAI tool, written out as a program against the OpenAI API writes it.
CALCULATOR_TOOL = {"type": "function", "function": {
    "name": "calculator",
    "description": "Evaluates an arithmetic expression with integers, + - * / and parentheses.",
    "parameters": {"type": "object", "required": ["expression"], "properties": {
        "expression": {"type": "string", "description": 'The expression to evaluate, for example "123 * 456".'}}}}}


async def openai_agent(endpoint, row):
    """The calculator task as an agent program on the `openai` client (the calculator-agent recipe): ask with the
    tool, run the calls the model makes, ask once more with their results. Returns None: the run's rewards score
    the episode's messages, as they score the calculator recipe's tool episodes."""
    import json

    import openai

    client = endpoint.client()
    messages = list(row["prompt"])
    reply = await client.chat.completions.create(model=endpoint.model, messages=messages, tools=[CALCULATOR_TOOL])
    message = reply.choices[0].message
    if not message.tool_calls or reply.choices[0].finish_reason == "length":  # answered, or the episode's budget ended
        return None
    messages.append(message.model_dump(exclude_none=True))
    for call in message.tool_calls:
        try:
            result = calculator(**json.loads(call.function.arguments))
        except Exception as e:  # noqa: BLE001  (the model is told what went wrong, as a tool runner tells it)
            result = {"error": str(e)}
        messages.append({"role": "tool", "tool_call_id": call.id, "name": "calculator", "content": str(result)})
    try:
        await client.chat.completions.create(model=endpoint.model, messages=messages, tools=[CALCULATOR_TOOL])
    except openai.BadRequestError as e:  # the result left no room to answer (context_length_exceeded)
        if e.code != "context_length_exceeded":
            raise
    return None
