"""Tool calls read in the tokenizer's own format. OpenAI's harmony format (gpt-oss), on a byte-level tokenizer
(SmolLM2's) given harmony's special tokens and gpt-oss's chat template as TRL 1.16 ships it: rlcu's harmony reader
against TRL's response parser for that template (`add_response_schema`), in the form the template writes a call
and in the form gpt-oss samples one; a tokenizer's response template read with the turn's prompt; a tool episode
on the harmony format."""
import importlib.resources

import pytest
from transformers import AutoTokenizer

from rlcu.agents.formats import parse_harmony, tool_format

trl_templates = pytest.importorskip("trl.chat_template_utils")
HARMONY = ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>"]
TOOLS = [{"type": "function", "function": {"name": "multiply", "description": "Multiply two integers.",
                                           "parameters": {"type": "object", "required": ["a", "b"], "properties": {
                                               "a": {"type": "integer"}, "b": {"type": "integer"}}}}}]
QUESTION = [{"role": "user", "content": "What is 3 * 4?"}]
TEMPLATE_CALL = ('<|channel|>analysis<|message|>Multiply.<|end|><|start|>assistant to=functions.multiply<|channel|>'
                 'commentary json<|message|>{"a": 3, "b": 4}<|call|>')
SAMPLED_CALL = ('<|channel|>analysis<|message|>Multiply.<|end|><|start|>assistant<|channel|>commentary '
                'to=functions.multiply <|constrain|>json<|message|>{"a": 3, "b": 4}<|call|>')
FINAL = "<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final<|message|>It is 12.<|return|>"


def harmony_tokenizer(folder, template: str = "gptoss.jinja"):
    tok = AutoTokenizer.from_pretrained(folder)
    tok.add_special_tokens({"additional_special_tokens": HARMONY})
    tok.chat_template = (importlib.resources.files("trl") / "chat_templates" / template).read_text()
    tok.eos_token = "<|return|>"
    return tok


@pytest.fixture(scope="module")
def harmony(smollm2_folder):
    return harmony_tokenizer(smollm2_folder)


def test_harmony_turns_read_as_trls_parser_reads_them(harmony):
    reference = harmony_tokenizer(harmony.name_or_path)
    trl_templates.add_response_schema(reference)
    prompt = harmony(harmony.apply_chat_template(QUESTION, tools=TOOLS, tokenize=False, add_generation_prompt=True),
                     add_special_tokens=False).input_ids
    fmt = tool_format("template", harmony)
    assert fmt.harmony
    for text in (TEMPLATE_CALL, FINAL):
        ids = harmony(text, add_special_tokens=False).input_ids
        ours, calls = fmt.parse(ids, prompt)
        assert ours == trl_templates.parse_response(reference, ids, prefix=prompt)
        assert ours == tool_format("template", reference).parse(ids, prompt)[0]  # the response template, with prefix
    message, calls = parse_harmony(SAMPLED_CALL)  # the channel before the recipient, as gpt-oss samples a call
    assert message == {"role": "assistant", "content": "", "thinking": "Multiply.", "tool_calls": [
        {"type": "function", "function": {"name": "multiply", "arguments": {"a": 3, "b": 4}}}]}
    assert [(c.name, c.arguments) for c in calls] == [("multiply", {"a": 3, "b": 4})]
    _, bad = parse_harmony('<|channel|>commentary to=functions.multiply json<|message|>{"a": 3<|call|>')
    assert bad[0].name == "multiply" and "not valid JSON" in bad[0].error


@pytest.mark.parametrize("template", ["gptoss.jinja", "gptoss_training.jinja"])
def test_a_tool_episode_in_the_harmony_format(smollm2_folder, template):
    """The model calls multiply in harmony's form, the tool's result comes back as the template writes a tool
    message, and the model answers: one episode, the call parsed and run, the result's tokens masked."""
    from rlcu.agents import AgentOptions, EpisodeRunner
    from rlcu.contracts import RolloutBatch, SamplingParams
    from rlcu.rollout.turns import generate_in_turns
    from tests.agents.test_episodes import multiply

    tok = harmony_tokenizer(smollm2_folder, template)
    stops = {tok.convert_tokens_to_ids("<|call|>"), tok.convert_tokens_to_ids("<|return|>")}

    def scripted(prompts, sampling):
        texts = [FINAL if "<|start|>functions.multiply" in tok.decode(p) else SAMPLED_CALL for p in prompts]
        out = [tok(t, add_special_tokens=False).input_ids for t in texts]
        return RolloutBatch([list(p) for p in prompts], out, [[-0.5] * len(c) for c in out],
                            ["stop" if c[-1] in stops else "length" for c in out])

    runner = EpisodeRunner([{"prompt": QUESTION}], AgentOptions.build(tok, [multiply], max_completion_length=400))
    out = generate_in_turns(scripted, runner.prompt_ids, SamplingParams(max_tokens=400), runner)
    episode = runner.record().completions[0]
    assert [m["role"] for m in episode] == ["assistant", "tool", "assistant"]
    assert episode[1]["content"] == "12" and episode[2]["content"] == "It is 12."
    appended = [t for t, m in zip(out.completion_ids[0], out.tool_mask[0]) if m == 0]
    assert "<|start|>functions.multiply to=assistant" in tok.decode(appended) and "12" in tok.decode(appended)
