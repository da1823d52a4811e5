"""Agents that are programs, through the OpenAI-compatible endpoint, with the real `openai` client: an episode of
three calls becomes one sample whose sampled tokens are the served ones and whose appended tokens are masked, the
engine's logprobs equal a fresh forward, streaming and tool calls come back in OpenAI's schema, and bad requests
get HTTP errors while the rollout goes on."""
import asyncio
import json
import re
import urllib.error
import urllib.request

import pytest
import torch
from transformers import AutoTokenizer

from rlcu.agents.formats import tool_format
from rlcu.agents.programs import ProgramRunner, load_program
from rlcu.contracts import SamplingParams
from rlcu.engine.llm_engine import EngineConfig, LLMEngine
from rlcu.grpo.logprobs import completion_logprobs
from rlcu.models import load_model
from tests.agents.scripted import ScriptedRollout, call
from tests.helpers import CHAT_TEMPLATE, tiny_hf_folder

openai = pytest.importorskip("openai")
ROWS = [{"prompt": "t3 t4", "n": 1}, {"prompt": "t9", "n": 2}]


@pytest.fixture
def tiny(tmp_path):
    model, tok = load_model(tiny_hf_folder(tmp_path, "qwen3", chat_template=CHAT_TEMPLATE))
    return model, tok


def runner_for(rows, program, tok, budget=40, timeout=60.0, fmt="template"):
    return ProgramRunner(rows, program, tool_format(fmt, tok), "policy", budget, timeout)


def run_episodes(model, runner, **sampling):
    """The rollout of the runner's episodes (40 tokens each at temperature 1, seed 0), then their record; the
    runner closed whatever happens."""
    try:
        sp = SamplingParams(max_tokens=40, temperature=1.0, seed=0, **sampling)
        out = LLMEngine(model, EngineConfig(max_num_seqs=8)).generate(runner.prompt_ids, sp, continuation=runner)
        return out, runner.record()
    finally:
        runner.close()


def on_backend(backend: str, model, tok, runner, max_turn_tokens: int):
    """The runner's episodes on a rollout backend by name, as the module asks it (`turns.generate`), each call's
    own max_tokens honoured; then their record, the runner closed whatever happens."""
    from rlcu.rollout import resolve_rollout, turns

    try:
        rollout = resolve_rollout(backend)
        rollout.setup(model, tok)
        sp = SamplingParams(max_tokens=40, max_turn_tokens=max_turn_tokens, temperature=1.0, seed=0,
                            first_turn_tokens=runner.first_turn_tokens)
        return turns.generate(rollout, runner.prompt_ids, sp, continuation=runner), runner.record()
    finally:
        runner.close()


async def three_calls(endpoint, row):
    """Three calls of one conversation: plain, then streamed, then plain; the reward is the row's n."""
    client = endpoint.client()
    models = await client.models.list()
    assert [m.id for m in models.data] == ["policy"]
    messages = [{"role": "user", "content": row["prompt"]}]
    first = await client.chat.completions.create(model=endpoint.model, messages=messages)
    messages += [first.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "t20 t21"}]
    stream = await client.chat.completions.create(model=endpoint.model, messages=messages, stream=True)
    text = "".join([chunk.choices[0].delta.content or "" async for chunk in stream])
    messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "t30"}]
    await client.chat.completions.create(model=endpoint.model, messages=messages)
    return float(row["n"])


def test_a_three_call_episode_is_one_sample_with_its_tokens_as_sampled(tiny):
    model, tok = tiny
    runner = runner_for(ROWS, three_calls, tok)
    out, episodes = run_episodes(model, runner, max_turn_tokens=5)
    assert episodes.columns["agent_returns"] == [1.0, 2.0]
    for i, row in enumerate(ROWS):
        assert out.prompt_ids[i] == tok(row["prompt"] + " ", add_special_tokens=False).input_ids
        ids, mask = out.completion_ids[i], out.tool_mask[i]
        # three sampled turns of 5 tokens, the two appended user messages masked out, token for token
        appended = [tok(t, add_special_tokens=False).input_ids for t in ("t20 t21 ", "t30 ")]
        assert mask == [1] * 5 + [0] * len(appended[0]) + [1] * 5 + [0] * len(appended[1]) + [1] * 5
        assert ids[5:5 + len(appended[0])] == appended[0]
        served = [m["content"] for m in episodes.completions[i] if m["role"] == "assistant"]
        sampled = [ids[:5], ids[5 + len(appended[0]):10 + len(appended[0])], ids[-5:]]
        assert served == [tok.decode(t, skip_special_tokens=True) for t in sampled]  # the agent got what was sampled
        lp, _ = completion_logprobs(model, torch.tensor([out.prompt_ids[i] + ids]), None, len(ids), 1.0)
        real = torch.tensor(mask, dtype=torch.bool)
        assert (lp[0][real] - torch.tensor(out.logprobs[i])[real]).abs().max() < 1e-5
    assert not runner.endpoint.loop, "the endpoint is left running"


def barrier_program(n: int):
    """Episodes that wait for each other between their two calls, as agents of one team do: no second call
    comes before every episode got its first answer."""
    answered = []

    async def team(endpoint, row):
        client = endpoint.client()
        messages = [{"role": "user", "content": row["prompt"]}]
        first = await client.chat.completions.create(model=endpoint.model, messages=messages)
        answered.append(1)
        while len(answered) < n:
            await asyncio.sleep(0.01)
        messages += [first.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "t20"}]
        await client.chat.completions.create(model=endpoint.model, messages=messages)
        return 1.0
    return team


@pytest.mark.parametrize("backend", ["native", "reference"])
def test_every_episode_may_wait_for_its_programs_next_call_at_once(tiny, backend):
    """24 episodes, more than the 16 threads a continuation gets by default: each ended turn waits in its thread
    for the program's next call, so with 16 the other 8 first answers were never sent and the team waited for
    them until its timeout."""
    model, tok = tiny
    rows = [{"prompt": f"t{3 + i % 20}"} for i in range(24)]
    runner = runner_for(rows, barrier_program(len(rows)), tok, timeout=20.0)
    out, episodes = on_backend(backend, model, tok, runner, max_turn_tokens=4)
    assert runner.waiting_turns == 24 and episodes.columns["agent_returns"] == [1.0] * 24
    assert all(sum(m) == 8 for m in out.tool_mask)  # two sampled turns of 4 tokens each


def test_the_episodes_clients_share_one_connection_pool_and_a_programs_own_loop_gets_its_own(tiny):
    """endpoint.client() on the programs' loop is a copy of one client (a new one costs tens of milliseconds of the
    interpreter, every episode); from a program's own thread and event loop it is a client of its own, which works
    there (connections cannot cross event loops)."""
    model, tok = tiny
    pools = []

    async def agent(endpoint, row):
        client = endpoint.client()
        pools.append(client._client)
        messages = [{"role": "user", "content": row["prompt"]}]
        first = await client.chat.completions.create(model=endpoint.model, messages=messages)
        messages += [first.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "t20"}]

        async def in_own_loop():
            own = endpoint.client()
            assert own._client not in pools
            return await own.chat.completions.create(model=endpoint.model, messages=messages)

        second = await asyncio.to_thread(asyncio.run, in_own_loop())
        return float(bool(second.choices[0].message.content is not None))

    out, episodes = run_episodes(model, runner_for(ROWS, agent, tok), max_turn_tokens=5)
    assert episodes.columns["agent_returns"] == [1.0, 1.0]
    assert len(pools) == 2 and pools[0] is pools[1]

def test_tool_calls_come_back_in_openai_schema_and_tool_results_extend_the_episode(smollm2_folder):
    """SmolLM2's real tokenizer and chat template (hermes tool format) and a scripted model that calls a tool,
    then answers."""
    tok = AutoTokenizer.from_pretrained(smollm2_folder)
    script = lambda text, turn: call("multiply", a=6, b=7) if turn == 0 else "42<|im_end|>"  # noqa: E731
    schema = {"type": "function", "function": {"name": "multiply", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}
    seen = {}

    async def agent(endpoint, row):
        client = endpoint.client()
        messages = [{"role": "user", "content": "What is 6 x 7?"}]
        first = await client.chat.completions.create(model=endpoint.model, messages=messages, tools=[schema])
        choice = first.choices[0]
        seen["finish_reason"], seen["call"] = choice.finish_reason, choice.message.tool_calls[0]
        args = json.loads(choice.message.tool_calls[0].function.arguments)
        messages += [choice.message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": choice.message.tool_calls[0].id,
                      "content": str(args["a"] * args["b"])}]
        final = await client.chat.completions.create(model=endpoint.model, messages=messages, tools=[schema])
        return 1.0 if final.choices[0].message.content.strip() == "42" else 0.0

    runner = runner_for([{"prompt": "q"}], agent, tok, budget=200, fmt="hermes")
    try:
        out = ScriptedRollout(tok, script).generate(runner.prompt_ids, SamplingParams(max_tokens=200),
                                                     continuation=runner)
        episodes = runner.record()
    finally:
        runner.close()
    assert seen["finish_reason"] == "tool_calls" and seen["call"].type == "function"
    assert seen["call"].function.name == "multiply" and json.loads(seen["call"].function.arguments) == {"a": 6, "b": 7}
    assert episodes.columns["agent_returns"] == [1.0]
    assert [m["role"] for m in episodes.completions[0]] == ["assistant", "tool", "assistant"]
    assert 0 in out.tool_mask[0] and out.tool_mask[0][-1] == 1


def test_the_calculator_recipes_openai_agent_calls_the_tool_and_its_episode_earns_both_rewards(smollm2_folder):
    """The calculator-agent recipe's program (rlcu.agents.calculator:openai_agent) on the real openai client and
    SmolLM2's template, with a scripted model that makes the call the question shows, then answers with its result:
    math_answer and tool_use score the episode's messages as they score the calculator recipe's tool episodes."""
    from rlcu.agents.calculator import openai_agent
    from rlcu.data.tasks import calculator
    from rlcu.rewards.math import MathAnswer
    from rlcu.rewards.tools import ToolUse

    tok = AutoTokenizer.from_pretrained(smollm2_folder)
    row = calculator(n=1, seed=3)[0]
    a, b = re.findall(r"(\d+) \* (\d+)", row["prompt"][0]["content"])[0]
    script = lambda text, turn: (call("calculator", expression=f"{a} * {b}") if turn == 0  # noqa: E731
                                 else f"The answer is {int(a) * int(b)}<|im_end|>")
    runner = runner_for([row], openai_agent, tok, budget=200, fmt="hermes")
    try:
        ScriptedRollout(tok, script).generate(runner.prompt_ids, SamplingParams(max_tokens=200), continuation=runner)
        episodes = runner.record()
    finally:
        runner.close()
    messages = episodes.completions[0]
    assert [m["role"] for m in messages] == ["assistant", "tool", "assistant"]
    assert messages[1]["content"] == row["answer"] and messages[2]["content"] == f"The answer is {row['answer']}"
    assert MathAnswer()([row["prompt"]], [messages], None, answer=[row["answer"]]) == [1.0]
    assert ToolUse()([row["prompt"]], [messages], None) == [1.0]

@pytest.mark.parametrize("cut", [-1, 0], ids=["budget-spent-by-the-call", "no-room-for-the-result"])
def test_a_tool_call_at_the_end_of_the_budget_ends_the_calculator_episode_cleanly(smollm2_folder, cut):
    """A call whose tool call spends the episode's budget is finish_reason "length" (no call can follow it; it was
    "tool_calls", and the next call got 404); one that leaves no room for the result gets OpenAI's 400
    context_length_exceeded. The calculator-agent program ends its episode on either, and the rollout goes on."""
    from rlcu.agents.calculator import openai_agent
    from rlcu.data.tasks import calculator

    tok = AutoTokenizer.from_pretrained(smollm2_folder)
    row = calculator(n=1, seed=3)[0]
    text = call("calculator", expression="1 * 2")
    budget = len(tok(text, add_special_tokens=False)["input_ids"]) + cut
    seen = []

    async def agent(endpoint, row):
        client = endpoint.client()
        original = client.chat.completions.create

        async def create(**kwargs):
            reply = await original(**kwargs)
            seen.append(reply.choices[0].finish_reason)
            return reply
        endpoint.client = lambda: client
        client.chat.completions.create = create
        return await openai_agent(endpoint, row)

    runner = runner_for([row], agent, tok, budget=budget, fmt="hermes")
    try:
        ScriptedRollout(tok, lambda text_, turn: text).generate(runner.prompt_ids, SamplingParams(max_tokens=budget),
                                                                 continuation=runner)
        episodes = runner.record()
    finally:
        runner.close()
    assert seen == ["length" if cut < 0 else "tool_calls"]
    assert [m["role"] for m in episodes.completions[0]] == ["assistant"]

def _post(url, body: bytes, key: str | None) -> tuple[int, dict]:
    headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(urllib.request.Request(url, body, headers), timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_bad_requests_get_http_errors_and_the_rollout_goes_on(tiny):
    model, tok = tiny
    statuses = {}

    async def hostile(endpoint, row):
        url = endpoint.base_url + "/chat/completions"
        good = json.dumps({"model": "policy", "messages": [{"role": "user", "content": "t1"}]}).encode()
        loop = asyncio.get_running_loop()
        post = lambda *a: loop.run_in_executor(None, _post, *a)  # noqa: E731
        statuses["wrong key"] = (await post(url, good, "rlcu-wrong"))[0]
        statuses["no key"] = (await post(url, good, None))[0]
        statuses["malformed"] = (await post(url, b"{not json", endpoint.api_key))[0]
        statuses["no messages"] = (await post(url, b'{"model": "policy"}', endpoint.api_key))[0]
        statuses["10 MB"] = (await post(url, b'{"x": "' + b"a" * (10 << 20) + b'"}', endpoint.api_key))[0]
        other = endpoint.base_url.replace("/episodes/", "/episodes/nope")
        statuses["unknown episode"] = (await post(other + "/chat/completions", good, endpoint.api_key))[0]
        status, first = await post(url, good, endpoint.api_key)  # the episode itself still works
        statuses["good"] = status
        branch = json.dumps({"messages": [{"role": "user", "content": "t2"}, {"role": "user", "content": "t3"}]})
        statuses["branch"] = (await post(url, branch.encode(), endpoint.api_key))[0]
        return 1.0

    runner = runner_for([{"prompt": "x"}], hostile, tok)
    try:
        sp = SamplingParams(max_tokens=20, max_turn_tokens=4, temperature=1.0, seed=0)
        out = LLMEngine(model).generate(runner.prompt_ids, sp, continuation=runner)
        episodes = runner.record()
        url = runner.endpoint.base_url(runner.episodes[0].id) + "/chat/completions"
        after = _post(url, json.dumps({"messages": [{"role": "user", "content": "t1"}]}).encode(),
                      runner.endpoint.api_key)[0]
    finally:
        runner.close()
    assert statuses == {"wrong key": 401, "no key": 401, "malformed": 400, "no messages": 400, "10 MB": 413,
                        "unknown episode": 404, "good": 200, "branch": 409}
    assert after == 404  # an episode that ended takes no more calls
    assert episodes.columns["agent_returns"] == [1.0] and len(out.completion_ids[0]) == 4


def test_a_program_that_fails_is_one_line_naming_the_episode(tiny):
    model, tok = tiny

    async def quits(endpoint, row):
        return 0.0

    with pytest.raises(RuntimeError, match=r"quits returned before its first call in episode 0"):
        runner_for([{"prompt": "x"}], quits, tok)

    async def raises(endpoint, row):
        await endpoint.client().chat.completions.create(model="policy", messages=[{"role": "user", "content": "t1"}])
        raise KeyError("boom")

    runner = runner_for([{"prompt": "x"}], raises, tok)
    try:
        LLMEngine(model).generate(runner.prompt_ids, SamplingParams(max_tokens=8, max_turn_tokens=4, seed=0),
                                  continuation=runner)
        with pytest.raises(RuntimeError, match=r"raises raised in episode 0 .*KeyError: 'boom'"):
            runner.record()
    finally:
        runner.close()
    with pytest.raises(ValueError, match="cannot be imported"):
        load_program("no_such_module:agent")


async def echo_target(endpoint, row):
    """A program as a user writes it: two calls, rewarded by whether the answer holds the row's target token."""
    client = endpoint.client()
    messages = [{"role": "user", "content": row["prompt"]}]
    reply = await client.chat.completions.create(model=endpoint.model, messages=messages)
    messages += [reply.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "t1"}]
    reply = await client.chat.completions.create(model=endpoint.model, messages=messages)
    return float(f"t{row['target']}" in reply.choices[0].message.content.split())


def test_a_grpo_step_trains_an_agent_program_through_the_endpoint(tmp_path):
    from rlcu.grpo.module import GRPOModule
    from tests.helpers import fit, toy_rows

    model, tok = load_model(tiny_hf_folder(tmp_path / "m", "qwen3", chat_template=CHAT_TEMPLATE))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    module = GRPOModule(model, tokenizer=tok, agent="tests.agents.test_programs:echo_target", num_generations=4,
                        max_completion_length=16, max_call_tokens=5, learning_rate=1e-2, micro_batch_size=8)
    assert [r.name for r in module.rewards] == ["agent"]
    metrics = fit(module, toy_rows(4), steps=1, log_dir=tmp_path)
    assert any("rewards/agent/mean" in m for m in metrics)
    assert any(m.get("episodes/mean_calls") == 2.0 for m in metrics)
    assert any(not torch.equal(before[n], p) for n, p in model.named_parameters())
    with pytest.raises(ValueError, match="give agent, or tools / environment_factory, not both"):
        GRPOModule(model, tokenizer=tok, agent=echo_target, tools=[len])


SERVED: dict[str, list] = {}


async def asks_logprobs(endpoint, row):
    """A plain call and a streamed one with `logprobs: true`; one with top_logprobs, which is refused."""
    client = endpoint.client()
    messages = [{"role": "user", "content": row["prompt"]}]
    with pytest.raises(openai.BadRequestError, match="top_logprobs"):
        await client.chat.completions.create(model=endpoint.model, messages=messages, logprobs=True, top_logprobs=2)
    first = await client.chat.completions.create(model=endpoint.model, messages=messages, logprobs=True)
    served = [(c.token, c.logprob) for c in first.choices[0].logprobs.content]
    messages += [first.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "t20"}]
    stream = await client.chat.completions.create(model=endpoint.model, messages=messages, stream=True, logprobs=True)
    served += [(c.token, c.logprob) async for chunk in stream if chunk.choices[0].logprobs
               for c in chunk.choices[0].logprobs.content]
    SERVED[row["prompt"]] = served
    return 1.0


def test_logprobs_are_served_as_the_engine_sampled_them(tiny):
    """OpenAI's `logprobs: true`, plain and streamed: each served token with the sampler's own logprob, the same
    numbers the rollout records for training."""
    model, tok = tiny
    runner = runner_for(ROWS, asks_logprobs, tok)
    try:
        sp = SamplingParams(max_tokens=40, max_turn_tokens=5, temperature=1.0, seed=0)
        out = LLMEngine(model, EngineConfig(max_num_seqs=8)).generate(runner.prompt_ids, sp, continuation=runner)
        runner.record()
    finally:
        runner.close()
    for i, row in enumerate(ROWS):
        sampled = [(t, lp) for t, lp, m in zip(out.completion_ids[i], out.logprobs[i], out.tool_mask[i]) if m]
        served = SERVED[row["prompt"]]
        assert len(served) == len(sampled) == 10
        assert [t for t, _ in served] == [tok.decode([t]) for t, _ in sampled]
        assert [lp for _, lp in served] == pytest.approx([lp for _, lp in sampled], abs=1e-6)


async def bounded_calls(endpoint, row):
    """Three calls, each with its own max_tokens (2, none, 3); a bad one first gets 400."""
    client = endpoint.client()
    with pytest.raises(openai.BadRequestError, match="max_tokens must be a positive integer"):
        await client.chat.completions.create(model=endpoint.model, messages=[{"role": "user", "content": "t1"}],
                                             max_tokens=0)
    messages, lengths = [{"role": "user", "content": row["prompt"]}], []
    for limit in (2, None, 3):
        extra = {} if limit is None else {"max_completion_tokens": limit} if limit == 3 else {"max_tokens": limit}
        answer = await client.chat.completions.create(model=endpoint.model, messages=messages, **extra)
        lengths.append((answer.usage.completion_tokens, answer.choices[0].finish_reason))
        messages += [answer.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "t20"}]
    return float(lengths == [(2, "length"), (5, "length"), (3, "length")])


@pytest.mark.parametrize("backend", ["native", "reference"])
def test_a_calls_max_tokens_bounds_what_it_samples(tiny, backend):
    model, tok = tiny
    runner = runner_for(ROWS, bounded_calls, tok)
    out, episodes = on_backend(backend, model, tok, runner, max_turn_tokens=5)
    assert runner.first_turn_tokens == [2, 2]
    assert episodes.columns["agent_returns"] == [1.0, 1.0]  # 2, 5 (the run's max_call_tokens) and 3 tokens
    assert [sum(m) for m in out.tool_mask] == [10, 10]


async def text_calls(endpoint, row):
    """A text episode through /completions: a string prompt, then (streamed) its extension, then token ids."""
    client = endpoint.client()
    first = await client.completions.create(model=endpoint.model, prompt=row["prompt"], max_tokens=4, logprobs=0)
    SERVED.setdefault("text", []).append(first.choices[0].logprobs.token_logprobs)
    text = row["prompt"] + first.choices[0].text + " t20 t21"
    stream = await client.completions.create(model=endpoint.model, prompt=text, max_tokens=3, stream=True)
    text += "".join([chunk.choices[0].text async for chunk in stream])
    return float(row["n"]), text


def test_a_text_episode_through_completions_is_one_sample(tiny):
    """/completions as vLLM serves it: a string prompt (tokenized with special tokens), its extension appended and
    masked, the served text the sampled tokens, logprobs as the engine sampled them (equal to a fresh forward),
    and the rewards get the text after the first prompt."""
    model, tok = tiny
    texts = {}

    async def program(endpoint, row):
        reward, texts[row["n"]] = await text_calls(endpoint, row)
        return reward

    SERVED.clear()
    rows = [{"prompt": "t3 t4", "n": 1}, {"prompt": "t9", "n": 2}]
    runner = runner_for(rows, program, tok)
    out, episodes = run_episodes(model, runner, max_turn_tokens=10, first_turn_tokens=runner.first_turn_tokens)
    assert episodes.columns["agent_returns"] == [1.0, 2.0]
    for i, row in enumerate(rows):
        assert out.prompt_ids[i] == tok(row["prompt"]).input_ids
        ids, mask = out.completion_ids[i], out.tool_mask[i]
        appended = tok(" t20 t21", add_special_tokens=False).input_ids
        assert mask == [1] * 4 + [0] * len(appended) + [1] * 3 and ids[4:4 + len(appended)] == appended
        served = tok.decode(ids[:4], skip_special_tokens=True) + " t20 t21" + tok.decode(ids[-3:],
                                                                                          skip_special_tokens=True)
        assert episodes.completions[i] == served == texts[row["n"]][len(row["prompt"]):]
        lp, _ = completion_logprobs(model, torch.tensor([out.prompt_ids[i] + ids]), None, len(ids), 1.0)
        assert (lp[0][:4] - torch.tensor(SERVED["text"][i])).abs().max() < 1e-5
        assert SERVED["text"][i] == out.logprobs[i][:4]


def test_text_episodes_take_token_ids_and_refuse_what_does_not_extend_them(tiny):
    model, tok = tiny
    statuses = {}

    async def program(endpoint, row):
        client = endpoint.client()
        first = await client.completions.create(model=endpoint.model, prompt=[5, 6, 7], max_tokens=3)
        extended = [5, 6, 7] + first.choices[0].token_ids + [9]
        await client.completions.create(model=endpoint.model, prompt=extended, max_tokens=2)
        for name, kwargs in {"branch": dict(prompt=[5, 6, 8]), "chat": None, "string": dict(prompt="t5"),
                             "alternatives": dict(prompt=[5], logprobs=2), "batch": dict(prompt=["t1", "t2"]),
                             "outside": dict(prompt=[10 ** 6])}.items():
            try:
                if kwargs is None:
                    await client.chat.completions.create(model=endpoint.model, messages=[{"role": "user",
                                                                                          "content": "t1"}])
                else:
                    await client.completions.create(model=endpoint.model, **kwargs)
            except openai.APIStatusError as e:
                statuses[name] = e.status_code
        return 1.0

    runner = runner_for([{"prompt": "x"}], program, tok)
    try:
        out = LLMEngine(model).generate(runner.prompt_ids, SamplingParams(
            max_tokens=20, temperature=1.0, seed=0, first_turn_tokens=runner.first_turn_tokens), continuation=runner)
        runner.record()
    finally:
        runner.close()
    assert out.prompt_ids[0] == [5, 6, 7] and len(out.completion_ids[0]) == 6 and out.completion_ids[0][3] == 9
    assert out.tool_mask[0] == [1, 1, 1, 0, 1, 1]
    assert statuses == {"branch": 409, "chat": 409, "string": 409, "alternatives": 400, "batch": 400, "outside": 400}


async def continue_text(endpoint, row):
    """A text agent on a base model: two /completions calls; a reward that varies between samples (the tiny model
    never earns a real one)."""
    client = endpoint.client()
    first = await client.completions.create(model=endpoint.model, prompt=row["prompt"], max_tokens=4)
    text = row["prompt"] + first.choices[0].text + " t1"
    second = await client.completions.create(model=endpoint.model, prompt=text, max_tokens=4)
    return float(sum(first.choices[0].token_ids + second.choices[0].token_ids) % 7)


def test_a_grpo_step_trains_a_text_agent_on_a_model_without_a_chat_template(tmp_path):
    from rlcu.grpo.module import GRPOModule
    from tests.helpers import fit, toy_rows

    model, tok = load_model(tiny_hf_folder(tmp_path / "m", "qwen3"))
    assert not tok.chat_template
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    module = GRPOModule(model, tokenizer=tok, agent=continue_text, num_generations=4, max_completion_length=16,
                        learning_rate=1e-2, micro_batch_size=8, seed=0)
    metrics = fit(module, toy_rows(4), steps=1, log_dir=tmp_path)
    assert any(m.get("episodes/mean_calls") == 2.0 for m in metrics)
    assert any(not torch.equal(before[n], p) for n, p in model.named_parameters())


async def content_parts(endpoint, row):
    """Messages whose content is a list of text parts, as agent frameworks (smolagents) send them; an image part
    gets HTTP 400 and the episode goes on."""
    client = endpoint.client()
    parts = [{"type": "text", "text": w} for w in row["prompt"].split()]
    messages = [{"role": "system", "content": [{"type": "text", "text": "t5"}]}, {"role": "user", "content": parts}]
    first = await client.chat.completions.create(model=endpoint.model, messages=messages)
    try:
        await client.chat.completions.create(model=endpoint.model, messages=messages + [
            first.choices[0].message.model_dump(exclude_none=True),
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}])
    except openai.BadRequestError as e:
        row["refused"] = e.message
    messages += [first.choices[0].message.model_dump(exclude_none=True),
                 {"role": "user", "content": [{"type": "text", "text": "t20"}, {"type": "text", "text": "t21"}]}]
    await client.chat.completions.create(model=endpoint.model, messages=messages)
    return 1.0


def test_text_content_parts_render_as_the_joined_text(tiny):
    model, tok = tiny
    rows = [{"prompt": "t3 t4"}]
    runner = runner_for(rows, content_parts, tok)
    out, episodes = run_episodes(model, runner, max_turn_tokens=5)
    fmt = tool_format("template", tok)
    assert out.prompt_ids[0] == fmt.prompt_ids([{"role": "system", "content": "t5"},
                                                {"role": "user", "content": "t3\nt4"}], None)
    assert episodes.completions[0][1] == {"role": "user", "content": "t20\nt21"}
    assert "only text content parts are supported, got one of type 'image_url'" in rows[0]["refused"]


async def branching(endpoint, row):
    """An episode of three conversations: the first (two calls), a retry of its first call's messages, and a
    sub-agent (two calls); the reward is the row's n."""
    client = endpoint.client()

    async def call(messages):
        return (await client.chat.completions.create(model=endpoint.model, messages=messages)).choices[0].message

    messages = [{"role": "user", "content": row["prompt"]}]
    first = await call(messages)
    await call(messages)  # the same messages again: another sample, a branch
    await call(messages + [first.model_dump(exclude_none=True), {"role": "user", "content": "t20"}])
    sub = [{"role": "user", "content": "t30 t31"}]
    answer = await call(sub)
    await call(sub + [answer.model_dump(exclude_none=True), {"role": "user", "content": "t40"}])
    return float(row["n"])


def test_calls_that_branch_become_samples_of_their_own_with_their_tokens_as_sampled(tiny):
    model, tok = tiny
    runner = ProgramRunner(ROWS, branching, tool_format("template", tok), "policy", 40, 60.0, max_branches=2)
    out, episodes = run_episodes(model, runner, max_turn_tokens=5)
    assert len(out) == 6 and sorted(episodes.branch_of) == [0, 0, 1, 1]
    assert episodes.columns["agent_returns"] == [1.0, 2.0] and episodes.metrics["episodes/mean_branches"] == 2.0
    fmt = tool_format("template", tok)
    t20, t40 = (fmt.suffix_ids([{"role": "user", "content": t}], None) for t in ("t20", "t40"))
    for j, root in enumerate(episodes.branch_of):
        i = 2 + j
        retry = out.prompt_ids[i] == out.prompt_ids[root]
        if not retry:  # the sub-agent's own conversation, rendered by the chat template
            assert out.prompt_ids[i] == fmt.prompt_ids([{"role": "user", "content": "t30 t31"}], None)
        assert out.tool_mask[i] == ([1] * 5 if retry else [1] * 5 + [0] * len(t40) + [1] * 5)
        if not retry:
            assert out.completion_ids[i][5:5 + len(t40)] == t40
    for i in range(2):
        assert out.tool_mask[i] == [1] * 5 + [0] * len(t20) + [1] * 5
    for p, c, lp, mask in zip(out.prompt_ids, out.completion_ids, out.logprobs, out.tool_mask):
        fresh, _ = completion_logprobs(model, torch.tensor([p + c]), None, len(c), 1.0)
        real = torch.tensor(mask, dtype=torch.bool)
        assert (fresh[0][real] - torch.tensor(lp)[real]).abs().max() < 1e-5
    assert not runner.endpoint.loop, "the endpoint is left running"


def test_branches_past_max_branches_and_text_branches(tiny):
    """A third conversation with max_branches=1 gets HTTP 409 naming the option; a /completions prompt that extends
    nothing branches in token ids."""
    model, tok = tiny
    statuses = []

    async def program(endpoint, row):
        client = endpoint.client()
        first = await client.completions.create(model=endpoint.model, prompt=[5, 6, 7], max_tokens=3)
        second = await client.completions.create(model=endpoint.model, prompt=[5, 6, 8], max_tokens=2)
        await client.completions.create(model=endpoint.model, prompt=[5, 6, 8] + second.choices[0].token_ids + [9],
                                        max_tokens=2)
        try:
            await client.completions.create(model=endpoint.model, prompt=[4], max_tokens=2)
        except openai.APIStatusError as e:
            statuses.append((e.status_code, "max_branches=1" in str(e)))
        return float(len(first.choices[0].token_ids))

    runner = ProgramRunner([{"prompt": "x"}], program, tool_format("template", tok), "policy", 20, 60.0,
                           max_branches=1)
    out, episodes = run_episodes(model, runner, first_turn_tokens=runner.first_turn_tokens)
    assert statuses == [(409, True)] and episodes.branch_of == [0]
    assert out.prompt_ids == [[5, 6, 7], [5, 6, 8]]
    assert out.tool_mask[1] == [1, 1, 0, 1, 1] and out.completion_ids[1][2] == 9


async def retries(endpoint, row):
    """Two samples of the row's prompt (the second a branch); the reward is the first answer's length in characters,
    modulo 5 (it varies between episodes)."""
    client = endpoint.client()
    messages = [{"role": "user", "content": row["prompt"]}]
    first = await client.chat.completions.create(model=endpoint.model, messages=messages)
    await client.chat.completions.create(model=endpoint.model, messages=messages)
    return float(len(first.choices[0].message.content) % 5)


def test_a_grpo_step_trains_branches_with_their_episodes_advantage(tmp_path, monkeypatch):
    from rlcu.grpo.module import GRPOModule
    from rlcu.grpo.score_phase import Scoring
    from tests.helpers import fit, toy_rows

    seen = []
    score = Scoring.__call__

    def keep(self, rows, sampled, scorer=None):
        out = score(self, rows, sampled, scorer)
        seen.append((sampled, out))
        return out

    monkeypatch.setattr(Scoring, "__call__", keep)
    model, tok = load_model(tiny_hf_folder(tmp_path / "m", "qwen3", chat_template=CHAT_TEMPLATE))
    module = GRPOModule(model, tokenizer=tok, agent=retries, num_generations=4, max_completion_length=16,
                        max_call_tokens=6, max_branches=1, learning_rate=1e-2, micro_batch_size=8, temperature=1.5)
    metrics = fit(module, toy_rows(2), steps=1, log_dir=tmp_path, batch_size=2)
    sampled, step = seen[0]
    n, branch_of = 8, sampled.episodes.branch_of
    assert len(step.batch) == len(sampled.batch) == 16 and sorted(branch_of) == list(range(8))
    advantages = step.batch.advantages
    assert torch.equal(advantages[n:], advantages[torch.tensor(branch_of)]) and advantages[:n].abs().sum() > 0
    assert torch.equal(step.scored.advantages, advantages[:n]) and len(step.scored.completions) == n
    assert (step.batch.loss_mask[n:].sum(1) > 0).all()  # the branches' sampled tokens train
    assert any(m.get("episodes/mean_branches") == 1.0 for m in metrics)
    with pytest.raises(ValueError, match="max_branches .* needs a rollout backend with the 'spawns' capability"):
        GRPOModule(model, tokenizer=tok, agent=retries, max_branches=1, rollout="reference")


def test_episode_completions_are_made_when_read():
    """A text episode's completion is decoded when the score phase reads it, once, not as the rollout ends."""
    from rlcu.agents.programs import Later

    made = []
    later = Later(lambda i: made.append(i) or f"text {i}", 3)
    assert made == [] and len(later) == 3
    assert later[-1] == "text 2" and later[1:] == ["text 1", "text 2"] and list(later) == ["text 0", "text 1", "text 2"]
    assert made == [2, 1, 0] and later == ["text 0", "text 1", "text 2"] and later != "text 0"
    with pytest.raises(IndexError):
        later[3]
