"""Token-in, token-out: a trajectory holds exactly the sampled tokens, every turn's prompt is the
previous prompt plus the sampled tokens plus the observation's tokens, the loss mask marks exactly
the sampled tokens, and the model's own text is never tokenized again. Checked for every env (with
its scripted expert) and for sampled rollouts under three chat templates (the embedded agent's, and the real Llama 3
and Qwen3 ones with their real tokenizers; tests/test_templates.py audits every real template on every env)."""

import importlib.util
import re

import pytest
import torch

import envs
from rl.agent import REACT
from rl.logprobs import collate, token_logprobs
from rl.model import load_model, load_tokenizer
from rollout import ChatFormat, ExpertEngine, HFEngine, rollout


@pytest.fixture(scope="module")
def tiny():
    tokenizer = load_tokenizer("tiny-agent")
    model = load_model("tiny-agent")
    return tokenizer, model


def random_model(tokenizer):
    """A 2-layer, 64-wide model with random weights and the tokenizer's whole vocabulary (Qwen2's architecture for
    Qwen's tokenizer, Llama's for Llama's): it samples the real BPE's tokens, merges and all, at a CPU's speed."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    qwen = "<|im_end|>" in tokenizer.get_vocab()
    config, model_class = (Qwen2Config, Qwen2ForCausalLM) if qwen else (LlamaConfig, LlamaForCausalLM)
    torch.manual_seed(0)
    return model_class(config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)).eval()


class Spy:
    """Wraps an engine and the format's encoder: records every prompt, every sample and every text
    that gets tokenized."""

    def __init__(self, engine, fmt):
        self.engine, self.prompts, self.samples, self.encoded = engine, {}, {}, []
        original = fmt.encode

        def encode(text):
            self.encoded.append(text)
            return original(text)

        fmt.encode = encode

    @property
    def continuous(self):
        return self.engine.continuous

    @property
    def pending(self):
        return self.engine.pending

    @property
    def progress(self):
        return self.engine.progress

    @property
    def name(self):
        return self.engine.name

    def abort(self):
        self.engine.abort()

    def submit(self, traj, limit):
        self.prompts.setdefault(traj.row, []).append(list(traj.token_ids))
        self.engine.submit(traj, limit)

    def poll(self):
        finished = self.engine.poll()
        for traj, sample in finished:
            self.samples.setdefault(traj.row, []).append(list(sample.token_ids))
        return finished


def exact_on(engine, fmt, name):
    """Two test tasks of env `name`, two episodes each, on `engine` (3 turns of at most 24 tokens): every turn is
    token-exact (check_exact) and at least one whole sequence renders as the template does."""
    spy = Spy(engine, fmt)
    test_ids = envs.splits(name)["test"][:2]
    environments = [envs.make(name) for _ in range(4)]
    try:
        trajectories = rollout(spy, fmt, environments, [t for t in test_ids for _ in range(2)], [0, 0, 1, 1],
                               horizon=3, max_new_tokens=24, max_tokens=8192)
    finally:
        for env in environments:
            env.close()
    assert all(t.error is None for t in trajectories), [t.error for t in trajectories]
    assert sum(t.turns for t in trajectories) >= 4
    assert check_exact(fmt, spy, trajectories) >= 1


def check_exact(fmt, spy, trajectories, renders=True, spaces=True):
    """renders: the whole sequence is also what the chat template renders for the conversation (False for a template
    that drops earlier reasoning, whose rendering the appended tokens do not follow by design); spaces=False: up to
    whitespace (a template that trims every message, as Llama 3's, renders a sampled reply without the whitespace
    around it)."""
    checked_text = 0
    for traj in trajectories:
        prompts, samples = spy.prompts.get(traj.row, []), spy.samples.get(traj.row, [])
        assert len(prompts) == traj.turns
        # the loss mask marks exactly the sampled tokens, in order
        assert [t for t, m in zip(traj.token_ids, traj.loss_mask) if m] == [t for s in samples for t in s]
        # every prompt extends the previous one by the sampled tokens and the observation
        observations = traj.messages[4::2]  # (user turns, or tool results under --agent tools)
        for k in range(1, len(prompts)):
            closed = samples[k - 1] if samples[k - 1][-1:] == [fmt.end_of_turn] else samples[k - 1] + [fmt.end_of_turn]
            observation = fmt.observation(observations[k - 1]["content"], observations[k - 1]["role"])
            assert prompts[k] == prompts[k - 1] + closed + observation
        if prompts:
            assert traj.token_ids[:len(prompts[-1])] == prompts[-1]
            assert traj.token_ids[len(prompts[-1]):len(prompts[-1]) + len(samples[-1])] == samples[-1]
        # the whole sequence is what the chat template renders for the conversation (turns cut
        # off by the limit included: they are closed with the end-of-turn token), whenever the
        # model sampled no special token inside a turn (the env sees text without those)
        specials = {i for i, token in fmt.tokenizer.added_tokens_decoder.items() if token.special}
        inner = [s[:-1] if s[-1:] == [fmt.end_of_turn] else s for s in samples]
        if renders and traj.error is None and traj.turns and not traj.tools and not any(specials & set(s) for s in inner):
            text = fmt.tokenizer.decode(traj.token_ids)
            if traj.finish in ("done", "horizon", "max_tokens"):  # the final observation is logged, not tokenized
                text += fmt.wrap(traj.messages[-1]["content"])
            shown = fmt.render(traj.messages, add_generation_prompt=True)
            assert text == shown if spaces else re.sub(r"\s", "", text) == re.sub(r"\s", "", shown)
            checked_text += 1
    # the model's text is never tokenized: only the first prompts and the observations are
    firsts = {fmt.render(t.messages[:3], add_generation_prompt=True, tools=t.tools) for t in trajectories}
    wrapped = {fmt.wrap(m["content"], m["role"]) for t in trajectories for m in t.messages[4::2]}
    assert set(spy.encoded) <= firsts | wrapped | set(getattr(spy.engine, "expert_texts", []))
    return checked_text


@pytest.mark.slow  # (~10 s: two real tokenizers)
@pytest.mark.parametrize("template", ["chatml", "llama3", "qwen3"])
def test_sampled_rollouts_are_token_exact(tiny, real_tokenizer, template):
    """The embedded agent (ChatML), and random-weight models sampling the real Llama 3 and Qwen3 tokenizers' tokens
    under their real templates (Llama 3's trims every message, so a sampled reply that starts or ends with whitespace
    renders without it: the rendering is compared up to whitespace there)."""
    if template == "chatml":
        tokenizer, model = tiny
    else:
        tokenizer = real_tokenizer(template)
        model = random_model(tokenizer)
    fmt = ChatFormat(tokenizer)
    engine = HFEngine(model, fmt, temperature=1.0, seed=3)
    spy = Spy(engine, fmt)
    environments = [envs.make("babyai") for _ in range(6)]
    trajectories = rollout(spy, fmt, environments, [1, 1, 2, 2, 44, 44], [0, 0, 1, 1, 2, 2],
                           horizon=4, max_new_tokens=24, max_tokens=4096)
    assert sum(t.turns for t in trajectories) >= 6
    assert check_exact(fmt, spy, trajectories, spaces=template != "llama3") >= 1


def test_turn_cut_by_the_token_limit_is_closed_unmasked(tiny):
    tokenizer, model = tiny
    fmt = ChatFormat(tokenizer)
    spy = Spy(HFEngine(model, fmt, temperature=1.0, seed=0), fmt)
    environments = [envs.make("babyai") for _ in range(2)]
    trajectories = rollout(spy, fmt, environments, [1, 2], [0, 1], horizon=2, max_new_tokens=3, max_tokens=4096)
    check_exact(fmt, spy, trajectories)
    cut = 0
    for traj in trajectories:
        # a 3-token turn that did not end itself is closed by an end-of-turn token with mask 0
        for prompt, sample in zip(spy.prompts[traj.row], spy.samples[traj.row]):
            assert len(sample) <= 3
            if sample[-1] != fmt.end_of_turn:
                pos = len(prompt) + len(sample)
                assert traj.token_ids[pos] == fmt.end_of_turn and traj.loss_mask[pos] == 0
                cut += 1
    assert cut >= 2


class NeverStops(torch.nn.Module):
    """A model that never samples a stop token: every turn runs to its token limit."""

    def __init__(self, model, stop_ids):
        super().__init__()
        self.model, self.stop_ids = model, sorted(stop_ids)

    @property
    def device(self):
        return self.model.device

    @property
    def config(self):
        return self.model.config

    def forward(self, **inputs):
        out = self.model(**inputs)
        out.logits[..., self.stop_ids] = float("-inf")
        return out


def test_token_budget_ends_the_episode(tiny):
    tokenizer, model = tiny
    fmt = ChatFormat(tokenizer)
    environments = [envs.make("babyai") for _ in range(2)]
    first = len(fmt.prompt(REACT.opening(environments[0], environments[0].reset(1))))
    # the budget, not the per-turn limit, cuts the first turn: the closing end-of-turn token must fit too
    trajectories = rollout(HFEngine(NeverStops(model, fmt.stop_ids), fmt, seed=0), fmt, environments, [1, 1], [0, 0],
                           horizon=10, max_new_tokens=64, max_tokens=first + 40)
    for traj in trajectories:
        assert len(traj.token_ids) == first + 40  # 39 sampled tokens and the unmasked end-of-turn
        assert traj.token_ids[-1] == fmt.end_of_turn and traj.loss_mask[-1] == 0
        assert traj.finish == "max_tokens" and traj.turns == 1


def test_every_turn_samples_exactly_the_per_turn_cap_when_the_model_does_not_stop(tiny):
    tokenizer, model = tiny
    fmt = ChatFormat(tokenizer)
    spy = Spy(HFEngine(NeverStops(model, fmt.stop_ids), fmt, seed=0), fmt)
    environments = [envs.make("babyai") for _ in range(2)]
    trajectories = rollout(spy, fmt, environments, [1, 2], [0, 1], horizon=3, max_new_tokens=7, max_tokens=4096)
    for traj in trajectories:
        assert [len(sample) for sample in spy.samples[traj.row]] == [7] * traj.turns
        assert sum(traj.loss_mask) == 7 * traj.turns


class Verbose(envs.Env):
    """An env whose first observation is `first_words` long and whose next ones are huge."""

    name, instruction, ack = "verbose", "Play.", "OK."

    def __init__(self, first_words):
        self.first_words = first_words

    def reset(self, task_id):
        return "word " * self.first_words

    def step(self, text):
        return envs.StepResult("word " * 100_000, 0.5, False)


def test_an_observation_or_prompt_past_the_budget_ends_the_episode_as_truncated(tiny):
    """Never an error: a first prompt longer than the budget ends the episode before any turn, and an
    observation that leaves no room for a reply ends it after the turn it answers (reward kept: a
    truncated episode is scored like one cut by the horizon, see rollout.py)."""
    tokenizer, model = tiny
    fmt = ChatFormat(tokenizer)
    environments = [Verbose(5000), Verbose(5)]
    trajectories = rollout(HFEngine(model, fmt, seed=0), fmt, environments, [0, 0], [0, 1], horizon=5,
                           max_new_tokens=8, max_tokens=1000)
    too_long, flooded = trajectories
    assert too_long.finish == "max_tokens" and too_long.turns == 0 and too_long.error is None
    assert sum(too_long.loss_mask) == 0 and too_long.reward == 0.0
    assert flooded.finish == "max_tokens" and flooded.turns == 1 and flooded.error is None
    assert flooded.reward == 0.5 and len(flooded.token_ids) <= 1000 and sum(flooded.loss_mask) > 0


@pytest.mark.slow
@pytest.mark.parametrize("name", envs.ENVS)
def test_expert_rollouts_are_token_exact_for_every_env(tiny, name):
    if importlib.util.find_spec(f"envs.{name}") is None:
        pytest.skip(f"envs.{name} is not ported yet")
    tokenizer, _ = tiny
    fmt = ChatFormat(tokenizer)
    test_ids = envs.splits(name)["test"][:2]
    environments = [envs.make(name) for _ in test_ids]
    engine = ExpertEngine(fmt, environments)
    spy = Spy(engine, fmt)
    texts = []
    original = engine.experts

    class Recording(dict):  # the expert's own text is new text, tokenized once like an observation
        def __setitem__(self, row, expert):
            def act(observation):
                text = expert(observation)
                texts.append(text)
                return text
            super().__setitem__(row, act)

    engine.experts = Recording(original)
    engine.expert_texts = texts
    try:
        trajectories = rollout(spy, fmt, environments, test_ids, list(range(len(test_ids))),
                               horizon=4, max_new_tokens=256, max_tokens=16384)
    finally:
        for env in environments:
            env.close()
    assert all(t.error is None or "expert failed" in t.error for t in trajectories)
    assert sum(t.turns for t in trajectories) >= 2
    assert check_exact(fmt, spy, trajectories) >= 1


def test_top_p_and_top_k_only_draw_from_the_head_of_the_distribution(tiny):
    tokenizer, model = tiny
    logits = torch.tensor([[4.0, 3.0, 0.0, -1.0, -2.0]]).repeat(500, 1)  # p = .72, .26, .01, ...
    fmt = ChatFormat(tokenizer)
    nucleus = HFEngine(model, fmt, temperature=1.0, top_p=0.9, seed=0)
    tokens, logprobs = nucleus._sample(logits)
    assert set(tokens.tolist()) == {0, 1}  # .72 < .9, so the second token is in the nucleus, the rest not
    assert torch.allclose(logprobs, logits.log_softmax(-1).gather(-1, tokens[:, None]).squeeze(-1))
    top1 = HFEngine(model, fmt, temperature=1.0, top_k=1, seed=0)
    assert set(top1._sample(logits)[0].tolist()) == {0}
    plain = HFEngine(model, fmt, temperature=1.0, seed=0)
    assert set(plain._sample(logits)[0].tolist()) >= {0, 1, 2}


def test_sampler_and_trainer_log_probs_agree(tiny):
    """The sampled log-probs are those the trainer computes for the same tokens under the same
    temperature (the key alignment invariant behind PPO's ratio); scoring at another temperature
    than the sampler's breaks it."""
    tokenizer, model = tiny
    fmt = ChatFormat(tokenizer)
    environments = [envs.make("babyai") for _ in range(4)]
    prefilled = []  # the rows of each turn's prefill: a prompt two rows share is prefilled once, then its cache copied
    hook = model.register_forward_pre_hook(lambda _, args, kwargs: prefilled.append(kwargs["input_ids"].shape)
                                           if kwargs["input_ids"].shape[1] > 1 else None, with_kwargs=True)
    try:
        trajectories = rollout(HFEngine(model, fmt, temperature=0.7, seed=5), fmt, environments, [1, 2, 1, 2],
                               [0, 1, 0, 1], horizon=2, max_new_tokens=16, max_tokens=4096)
    finally:
        hook.remove()
    assert prefilled[0][0] == 2 and trajectories[0].token_ids != trajectories[2].token_ids  # (each row drew its own)
    batch = collate(trajectories, fmt.pad_id)
    mask = batch["loss_mask"]

    def difference(temperature):
        with torch.no_grad():
            logprobs, _ = token_logprobs(model, batch["input_ids"], batch["attention_mask"], mask, temperature)
        gap = (logprobs - batch["sampler_logprobs"]).abs() * mask
        return float(gap.sum() / mask.sum()), float(gap.max())

    mean, worst = difference(0.7)
    assert mean < 1e-5 and worst < 1e-4
    assert difference(1.0)[0] > 1e-2


def test_decoding_in_place_on_grouped_heads_is_transformers_own_decoding(tiny):
    """The HF engine's cache grows in place and its one-token steps attend on grouped heads (rl/engines/hf.py): the
    same tokens and, up to the order of a sum, the same log-probs as transformers' own cache and SDPA, for rows of
    different lengths (padding), rows that share a prompt (prefilled once) and a cache that outgrows its room."""
    from transformers import DynamicCache
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from rl.engines.hf_decoding import GrowingLayer, decode_cache

    tokenizer, model = tiny
    assert model.config.num_attention_heads > model.config.num_key_value_heads  # grouped-query attention
    fmt = ChatFormat(tokenizer)
    prompts = [fmt.prompt([{"role": "user", "content": text}]) for text in ("go to the red ball", "pick up the key",
                                                                            "go to the red ball", "open the door")]
    engine = HFEngine(model, fmt, temperature=0.0)
    samples = engine._generate(prompts, [24, 24, 24, 7])
    assert ALL_ATTENTION_FUNCTIONS["sdpa"] is sdpa_attention_forward  # (restored after decoding)

    width = max(map(len, prompts))
    ids = torch.tensor([[fmt.pad_id] * (width - len(p)) + p for p in prompts])
    attention = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    positions = (attention.cumsum(-1) - 1).clamp(min=0)
    cache = DynamicCache(config=model.config)
    tokens, logprobs = [], []
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=attention, position_ids=positions,
                       past_key_values=cache).logits[:, -1]
        for _ in range(24):
            logp = logits.log_softmax(-1)
            token = logp.argmax(-1)
            tokens.append(token)
            logprobs.append(logp.gather(-1, token[:, None]).squeeze(-1))
            attention = torch.cat([attention, attention.new_ones((len(prompts), 1))], dim=1)
            positions = positions[:, -1:] + 1
            logits = model(input_ids=token[:, None], attention_mask=attention, position_ids=positions,
                           past_key_values=cache).logits[:, -1]
    tokens, logprobs = torch.stack(tokens, 1).tolist(), torch.stack(logprobs, 1)
    for row, sample in enumerate(samples):
        n = len(sample.token_ids)
        assert 0 < n and sample.token_ids == tokens[row][:n]
        assert torch.allclose(torch.tensor(sample.logprobs), logprobs[row, :n], atol=1e-5)
    assert len(samples[3].token_ids) <= 7 and samples[0].token_ids == samples[2].token_ids

    grown = decode_cache(model.config, room=200)  # buffers of 64 tokens' room at first, grown when full
    assert all(isinstance(layer, GrowingLayer) for layer in grown.layers)
    config = model.config
    keys = torch.randn(3, config.num_key_value_heads, 5 + 100, config.hidden_size // config.num_attention_heads)
    layer = grown.layers[0]
    layer.update(keys[:, :, :5], keys[:, :, :5])
    layer.reorder_cache(torch.tensor([2, 0]))  # (the prefill's rows picked)
    for step in range(5, 105):
        layer.update(keys[[2, 0], :, step:step + 1], keys[[2, 0], :, step:step + 1])
        if step == 50:
            layer.reorder_cache(torch.tensor([1, 0]))  # (rows picked from the buffers too)
            keys = keys[[2, 1, 0]]  # (so that each row goes on with its own stream)
    assert layer.keys.shape[-2] == 105 and layer.key_buffer.shape[-2] < 105 + 64
    assert torch.equal(layer.keys, keys[[2, 0]]) and torch.equal(layer.values, keys[[2, 0]])
