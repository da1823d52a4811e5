"""An OpenEnv environment, written with openenv-core's own classes and served by its own FastAPI app over WebSocket
on localhost, trains through `environment_factory` as TRL's OpenEnv integration wires it: a class whose `reset`
starts the server-side episode and whose tool method sends the policy's action as a `step`."""
import socket
import threading
import time

import pytest

from rlcu.agents import AgentOptions, EpisodeRunner
from rlcu.contracts import SamplingParams
from rlcu.models import load_model
from tests.agents.scripted import ScriptedRollout, call
from tests.helpers import fit

openenv = pytest.importorskip("openenv.core")
uvicorn = pytest.importorskip("uvicorn")
from openenv.core.client_types import StepResult  # noqa: E402


class CounterAction(openenv.Action):
    step: int


class CounterObservation(openenv.Observation):
    count: int = 0


class CounterEnvironment(openenv.Environment):
    """The server side: a counter the agent raises; the reward is the count."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def reset(self, seed=None, episode_id=None, **kwargs) -> CounterObservation:
        self._state = openenv.State(episode_id=episode_id or "e", step_count=0)
        self.count = 0
        return CounterObservation(count=0, done=False, reward=0.0)

    def step(self, action: CounterAction, timeout_s=None, **kwargs) -> CounterObservation:
        self._state.step_count += 1
        self.count += action.step
        return CounterObservation(count=self.count, done=False, reward=float(self.count))

    @property
    def state(self) -> openenv.State:
        return self._state


class CounterClient(openenv.EnvClient):
    """The client side, as an OpenEnv environment package ships it."""

    def _step_payload(self, action):
        return action.model_dump()

    def _parse_result(self, payload):
        observation = CounterObservation(**payload["observation"], done=payload["done"], reward=payload.get("reward"))
        return StepResult(observation=observation, reward=payload.get("reward"), done=payload["done"])

    def _parse_state(self, payload):
        return openenv.State(**payload)


@pytest.fixture(scope="module")
def server():
    app = openenv.create_fastapi_app(CounterEnvironment, CounterAction, CounterObservation, max_concurrent_envs=8)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not srv.started and time.monotonic() < deadline:
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}"
    srv.should_exit = True
    thread.join(10)


@pytest.fixture(scope="module")
def guide(server, smollm2_folder):
    """docs/agents.md's OpenEnv example, run on SmolLM2 against the server: its namespace (`Counter`, `module`)."""
    from tests.integration.test_readme_example import README, python_blocks

    model, tok = load_model(smollm2_folder)
    scope = {"model": model, "tokenizer": tok, "server_url": server, "CounterClient": CounterClient,
             "CounterAction": CounterAction}
    exec(python_blocks(README.parent / "docs" / "agents.md")[1], scope)
    return scope


def test_an_openenv_environment_answers_each_tool_call_from_its_server(guide):
    tokenizer = guide["tokenizer"]
    rows = [{"prompt": [{"role": "user", "content": "Count to 5."}]}] * 2
    agent = AgentOptions.build(tokenizer, environment_factory=guide["Counter"], tool_format_name="hermes",
                               max_completion_length=300)
    runner = EpisodeRunner(rows, agent)
    script = lambda history, turn: call("increment", step=turn + 2) if turn < 2 else "Done.<|im_end|>"  # noqa: E731
    ScriptedRollout(tokenizer, script).generate(runner.prompt_ids, SamplingParams(max_tokens=300), runner)
    assert [m["content"] for m in runner.completions[0] if m["role"] == "tool"] == ["2", "5"]
    assert [env.client.state().step_count for env in runner.environments] == [2, 2]  # the server's own episode
    assert guide["from_environment"](runner.environments) == [5.0, 5.0]


@pytest.mark.slow
def test_the_agents_guide_openenv_example_trains_a_grpo_step_on_the_engine(guide, tmp_path):
    rows = [{"prompt": [{"role": "user", "content": "Count to 5 with the tool."}]}] * 2
    metrics = fit(guide["module"], rows, 1, tmp_path)[-1]
    assert "rewards/from_environment/mean" in metrics and "episodes/mean_turns" in metrics
