"""Multi-turn rollout: batched generation for every live trajectory, environments stepped in parallel.

    trajectories = rollout(engine, fmt, envs, task_ids, groups, horizon=..., max_new_tokens=..., max_tokens=...)

One env per trajectory (the caller repeats each task n times). Each round generates the next
assistant turn of every live trajectory in one batched call, hands the decoded text to env.step in
a thread pool, and appends the observation, until the env says done, the turn cap (the horizon) is
reached or the token budget is spent. The outcome reward is the last step's reward, as upstream.

Token-in, token-out: a Trajectory holds exactly the token ids the engine sampled. The model's own
tokens are never decoded and re-encoded; only new text (the first prompt and each observation,
wrapped in the chat template's scaffolding) is ever tokenized, so turn k+1's prompt is turn k's
prompt plus the sampled tokens plus the observation's tokens. The loss mask is 1 on sampled tokens
(including the end-of-turn token when the model sampled it) and 0 on everything else; a turn cut
off by the token limit is closed with an end-of-turn token that has mask 0, since the model did not
choose it. The final observation (after the last turn, or one that would leave no room for a
reply within max_tokens) is kept in `messages` but not appended as tokens: nothing after it is
trained, so it would only cost compute.

Engines: HFEngine (any Hugging Face causal LM, own KV-cache sampling loop so that memory stays
O(batch) rather than O(batch x new tokens x vocab)) and ExpertEngine (the envs' scripted oracles,
for SFT data and tests, through exactly the same token layout).
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

import envs as envs_lib
from envs import Env

# ----------------------------------------------------------------------------------------------
# Data


@dataclass
class Trajectory:
    env: str
    task_id: int
    group: int  # the n samples of one task share a group
    row: int  # index of this trajectory's env in the rollout
    messages: list[dict]
    token_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)  # 1 on tokens the policy is trained on
    logprobs: list[float] = field(default_factory=list)  # the sampler's log-prob of each token (0 where loss_mask is 0)
    turns: int = 0
    reward: float = 0.0
    done: bool = False
    finish: str = ""  # "done" | "horizon" | "max_tokens" | "error"
    error: str | None = None
    success: bool = False

    def add(self, ids: list[int], logprobs: list[float] | None = None, trained: bool = False) -> None:
        """Append tokens: sampled ones with their log-probs and trained=True, anything else untrained."""
        self.token_ids += ids
        self.loss_mask += [int(trained)] * len(ids)
        self.logprobs += logprobs if trained else [0.0] * len(ids)

    def fail(self, error: str) -> None:
        self.finish, self.error, self.reward = "error", error, 0.0

    @property
    def item_id(self) -> str:
        return f"{self.env}_{self.task_id}"

    @property
    def live(self) -> bool:
        return not self.finish

    def log_record(self) -> dict:
        return {
            "item_id": self.item_id, "group": self.group, "reward": self.reward, "success": self.success,
            "turns": self.turns, "finish": self.finish, "error": self.error, "tokens": len(self.token_ids),
            "action_tokens": sum(self.loss_mask), "messages": self.messages,
        }


@dataclass
class Sample:
    token_ids: list[int]  # what was sampled, ending with a stop token unless the limit cut it off
    logprobs: list[float] = field(default_factory=list)
    error: str | None = None  # this row could not be generated; its trajectory ends with the error


# ----------------------------------------------------------------------------------------------
# Chat format: how messages become tokens, read off the tokenizer's own chat template


class ChatFormat:
    """The three pieces of text a rollout needs from a chat template: the first prompt, the
    scaffolding around an observation (what follows an assistant's end-of-turn token up to the
    next generation prompt), and the end-of-turn token itself. Found once by rendering sentinel
    messages, so any template that renders history as a prefix works (ChatML/Qwen, Llama 3, ...)."""

    _USER, _ASSISTANT, _NEXT = "\x02user-sentinel\x03", "\x02assistant-sentinel\x03", "\x02next-sentinel\x03"

    def __init__(self, tokenizer):
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(
                f"{tokenizer.name_or_path} has no chat template; use an instruct/chat model (or set "
                "tokenizer.chat_template) so that turns can be formatted"
            )
        self.tokenizer = tokenizer
        history = [{"role": "user", "content": self._USER}, {"role": "assistant", "content": self._ASSISTANT}]
        text = self.render(history + [{"role": "user", "content": self._NEXT}], add_generation_prompt=True)
        after = text.index(self._ASSISTANT) + len(self._ASSISTANT)
        specials = sorted(set(tokenizer.all_special_tokens) | set(tokenizer.get_added_vocab()), key=len, reverse=True)
        eot = next((s for s in specials if s and text.startswith(s, after)), None)
        if eot is None:
            raise ValueError(f"cannot find the end-of-turn token after an assistant message in {tokenizer.name_or_path}'s chat template")
        self.end_of_turn = tokenizer.convert_tokens_to_ids(eot)
        start = after + len(eot)
        split = text.index(self._NEXT)
        self.observation_prefix, self.observation_suffix = text[start:split], text[split + len(self._NEXT):]
        eos = tokenizer.eos_token_id
        self.stop_ids = {self.end_of_turn} | set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.end_of_turn

    def render(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def prompt(self, env: Env, observation: str) -> list[int]:
        messages = [{"role": "user", "content": env.instruction}, {"role": "assistant", "content": env.ack},
                    {"role": "user", "content": observation}]
        return self.encode(self.render(messages, add_generation_prompt=True))

    def observation(self, text: str) -> list[int]:
        return self.encode(self.observation_prefix + text + self.observation_suffix)

    def text(self, sampled: list[int]) -> str:
        """The assistant's text as the env sees it (special tokens such as end-of-turn dropped)."""
        return self.tokenizer.decode(sampled, skip_special_tokens=True)


# ----------------------------------------------------------------------------------------------
# Engines: generate the next turn for a batch of live trajectories


class HFEngine:
    """Sampling with a Hugging Face causal LM and its KV cache. Prompts are left-padded; each row
    stops at a stop token or its own token limit. Log-probs are taken under softmax(logits / T),
    the distribution the trainer scores (top-p/top-k only narrow what is drawn)."""

    def __init__(self, model, fmt: ChatFormat, temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0,
                 batch_size: int = 64, seed: int = 0):
        self.model, self.fmt = model, fmt
        self.temperature, self.top_p, self.top_k, self.batch_size = temperature, top_p, top_k, batch_size
        self.generator = torch.Generator(device=model.device).manual_seed(seed)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The sampler's random state, so that a resumed run draws what the uninterrupted one would."""
        return {"generator": self.generator.get_state()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.generator.set_state(state["generator"])

    def generate(self, batch: list[Trajectory], limits: list[int]) -> list[Sample]:
        prompts = [traj.token_ids for traj in batch]
        samples = []
        for i in range(0, len(prompts), self.batch_size):
            samples += self._generate(prompts[i:i + self.batch_size], limits[i:i + self.batch_size])
        return samples

    @torch.no_grad()
    def _generate(self, prompts: list[list[int]], limits: list[int]) -> list[Sample]:
        from transformers import DynamicCache

        if max(limits) <= 0:
            return [Sample([]) for _ in prompts]
        model, device = self.model, self.model.device
        was_training = model.training
        model.eval()
        width = max(map(len, prompts))
        input_ids = torch.full((len(prompts), width), self.fmt.pad_id, dtype=torch.long)
        attention = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, prompt in enumerate(prompts):
            input_ids[row, width - len(prompt):] = torch.tensor(prompt)
            attention[row, width - len(prompt):] = 1
        input_ids, attention = input_ids.to(device), attention.to(device)
        positions = (attention.cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache(config=model.config)
        logits = model(input_ids=input_ids, attention_mask=attention, position_ids=positions,
                       past_key_values=cache, use_cache=True, logits_to_keep=1).logits[:, -1]
        stop = torch.tensor(sorted(self.fmt.stop_ids), device=device)
        limit = torch.tensor(limits, device=device)
        finished = limit <= 0
        tokens, logprobs = [], []
        for step in range(max(limits)):
            token, logprob = self._sample(logits.float())
            tokens.append(token)
            logprobs.append(logprob)
            finished = finished | torch.isin(token, stop) | (limit <= step + 1)
            if finished.all():
                break
            attention = torch.cat([attention, attention.new_ones((len(prompts), 1))], dim=1)
            positions = positions[:, -1:] + 1
            logits = model(input_ids=token[:, None], attention_mask=attention, position_ids=positions,
                           past_key_values=cache, use_cache=True).logits[:, -1]
        model.train(was_training)

        tokens, logprobs = torch.stack(tokens, 1).tolist(), torch.stack(logprobs, 1).tolist()
        samples = []
        for row, limit_row in enumerate(limits):
            ids = tokens[row][:max(limit_row, 0)]
            end = next((k + 1 for k, t in enumerate(ids) if t in self.fmt.stop_ids), len(ids))
            samples.append(Sample(ids[:end], logprobs[row][:end]))
        return samples

    def _sample(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.temperature <= 0:
            token = logits.argmax(-1)
            return token, logits.log_softmax(-1).gather(-1, token[:, None]).squeeze(-1)
        logp = (logits / self.temperature).log_softmax(-1)
        weights = logp.clone()
        if self.top_k > 0:
            kth = weights.topk(min(self.top_k, weights.shape[-1]), dim=-1).values[:, -1:]
            weights = weights.masked_fill(weights < kth, float("-inf"))
        if self.top_p < 1.0:
            sorted_logp, order = weights.sort(-1, descending=True)
            before = sorted_logp.softmax(-1).cumsum(-1) - sorted_logp.softmax(-1)  # mass strictly above
            sorted_logp = sorted_logp.masked_fill(before >= self.top_p, float("-inf"))
            weights = torch.full_like(weights, float("-inf")).scatter(-1, order, sorted_logp)
        token = torch.multinomial(weights.softmax(-1), 1, generator=self.generator).squeeze(-1)
        return token, logp.gather(-1, token[:, None]).squeeze(-1)


class ExpertEngine:
    """The envs' scripted experts (envs.oracle) behind the engine interface: each "sample" is the
    expert's response to the latest observation, tokenized, plus the end-of-turn token. Makes SFT
    data, and test rollouts, with exactly the token layout of RL rollouts."""

    def __init__(self, fmt: ChatFormat, environments: list[Env]):
        self.fmt, self.environments, self.experts = fmt, environments, {}

    def generate(self, batch: list[Trajectory], limits: list[int]) -> list[Sample]:
        samples = []
        for traj, limit in zip(batch, limits):
            if traj.turns == 0:  # first turn after a reset: a fresh expert for this episode
                self.experts[traj.row] = envs_lib.oracle(self.environments[traj.row])
            try:
                text = self.experts[traj.row](traj.messages[-1]["content"])
            except RuntimeError as error:  # a task this expert cannot play
                samples.append(Sample([], error=f"expert failed: {error}"))
                continue
            ids = (self.fmt.encode(text) + [self.fmt.end_of_turn])[:max(limit, 0)]
            samples.append(Sample(ids, [0.0] * len(ids)))
        return samples


# ----------------------------------------------------------------------------------------------
# The rollout loop


def _guard(fn, *args):
    """Run an env call; infrastructure failures come back as the exception, never raised."""
    try:
        return fn(*args)
    except Exception as error:  # noqa: BLE001 - any env failure ends one trajectory, not the run
        return error


def rollout(engine, fmt: ChatFormat, environments: list[Env], task_ids: list[int], groups: list[int], *,
            horizon: int, max_new_tokens: int, max_tokens: int, pool: ThreadPoolExecutor | None = None,
            stats: dict | None = None) -> list[Trajectory]:
    """Play one episode per env: environments[i] plays task_ids[i], in group groups[i], for at most
    `horizon` turns. `stats`, when given, receives timing and token counts for throughput metrics."""
    assert len(environments) == len(task_ids) == len(groups)
    own_pool = pool is None
    pool = pool or ThreadPoolExecutor(max_workers=min(32, len(environments)))
    clock = {"generate_s": 0.0, "env_s": 0.0, "sampled_tokens": 0}
    try:
        # -- reset every env in parallel; the first observation completes each prompt
        start = time.perf_counter()
        firsts = list(pool.map(_guard, [env.reset for env in environments], task_ids))
        clock["env_s"] += time.perf_counter() - start
        trajectories = [_start(fmt, row, *args) for row, args in enumerate(zip(environments, task_ids, groups, firsts))]

        for _ in range(horizon):
            for traj in trajectories:  # a first prompt that leaves no room for a reply
                if traj.live and _room(traj, max_tokens) < 1:
                    traj.finish = "max_tokens"
            live = [t for t in trajectories if t.live]
            if not live:
                break

            # -- generate the next turn of every live trajectory in one batched call
            start = time.perf_counter()
            limits = [min(max_new_tokens, _room(t, max_tokens)) for t in live]
            samples = engine.generate(live, limits)
            clock["generate_s"] += time.perf_counter() - start
            acting = []
            for traj, sample in zip(live, samples):
                if sample.error is not None:
                    traj.fail(sample.error)
                    continue
                _act(fmt, traj, sample)
                clock["sampled_tokens"] += len(sample.token_ids)
                acting.append(traj)

            # -- step the envs in parallel with the raw text
            start = time.perf_counter()
            steps = [environments[t.row].step for t in acting]
            results = list(pool.map(_guard, steps, [t.messages[-1]["content"] for t in acting]))
            clock["env_s"] += time.perf_counter() - start
            for traj, result in zip(acting, results):
                _observe(fmt, traj, result, horizon, max_tokens)
        for traj in trajectories:
            if traj.live:
                traj.finish = "horizon"
        return trajectories
    finally:
        if own_pool:
            pool.shutdown(wait=True)
        if stats is not None:
            stats.update(clock)


def _start(fmt: ChatFormat, row: int, env: Env, task_id: int, group: int, first) -> Trajectory:
    """A trajectory whose tokens are the first prompt (instruction, ack, first observation)."""
    messages = [{"role": "user", "content": env.instruction}, {"role": "assistant", "content": env.ack}]
    traj = Trajectory(env.name, task_id, group, row, messages)
    if isinstance(first, Exception):
        traj.fail(f"reset failed: {type(first).__name__}: {first}")
        return traj
    messages.append({"role": "user", "content": first})
    traj.add(fmt.prompt(env, first))
    return traj


def _act(fmt: ChatFormat, traj: Trajectory, sample: Sample) -> None:
    """Append a sampled turn, trained on, and the message the env will read."""
    traj.add(sample.token_ids, sample.logprobs, trained=True)
    if sample.token_ids[-1:] != [fmt.end_of_turn]:
        # cut off by the limit, or stopped on another eos: the template needs the end-of-turn token,
        # which the model did not choose, so it is not trained on
        traj.add([fmt.end_of_turn])
    traj.messages.append({"role": "assistant", "content": fmt.text(sample.token_ids)})
    traj.turns += 1


def _observe(fmt: ChatFormat, traj: Trajectory, result, horizon: int, max_tokens: int) -> None:
    """Record the env's answer to a turn; append the observation's tokens if another turn follows."""
    if isinstance(result, Exception):
        traj.fail(f"step failed: {type(result).__name__}: {result}")
        return
    traj.reward, traj.done = float(result.reward), bool(result.done)
    traj.success = bool(result.info.get("success", result.reward > 0)) if result.done else False
    traj.messages.append({"role": "user", "content": result.observation})
    if traj.done:
        traj.finish = "done"
    elif traj.turns < horizon:
        observation = fmt.observation(result.observation)
        if _room(traj, max_tokens) - len(observation) < 1:  # no room left for a reply
            traj.finish = "max_tokens"
        else:
            traj.add(observation)


def _room(traj: Trajectory, max_tokens: int) -> int:
    """Tokens the next turn may sample: what is left of the budget, less one for the end-of-turn token
    that closes a turn the model did not end itself, so that no trajectory exceeds max_tokens."""
    return max_tokens - len(traj.token_ids) - 1
