"""TRL's GRPOTrainer training the embedded agent on our BabyAI through OpenEnv: the "out" direction end to end
(issue 63, item 3; docs/environments.md, "Bring your own environment"). It is written as a TRL user writes it:
OpenEnv's client, TRL and transformers, nothing of this project's code but the served env.

    python -m envs.standards.openenv_server --env babyai --port 8000 &
    ~/.cache/agentgym-rl/bench-trl-1.16.0/bin/python scripts/trl_openenv.py --url http://127.0.0.1:8000 --steps 4

TRL lives in a throwaway venv, never in this project's environment (`python scripts/bench.py --sections trl` makes
it: --system-site-packages over this project's torch and transformers, TRL 1.16.0 added; openenv-core comes from
requirements-standards.txt). The episodes are played by `rollout_func`, TRL's hook for multi-turn rollouts: each
turn the trainer's own model samples a reply for every episode still playing (one batched generate, left padded),
each reply goes to the episode's OpenEnv session (a WebSocket each) and the observation that comes back is rendered
by the chat template as the next user turn. A completion is every token after the first prompt: the sampled ones
(env_mask 1, with their sampling log-probs) and the template's tokens around each observation (env_mask 0, never
trained), so TRL's update sees exactly the tokens that were sampled. The reward is the episode's last reward (our
envs report the outcome so far, not an increment).

The figures it prints (reward per step, seconds per step) are in docs/environments.md. The settings are the embedded
agent's default run's (python train.py): its 5 BabyAI levels' train tasks, groups of 8, 8 tasks a step, 6 turns of
at most 48 tokens, lr 2e-4, temperature 1, token-mean loss (TRL's dapo), no KL.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="the OpenEnv server of our BabyAI")
    parser.add_argument("--model", default=str(ROOT / "assets" / "tiny-agent"), help="a causal LM directory or hub id")
    parser.add_argument("--tasks", default=str(ROOT / "envs" / "data" / "babyai_tiny_train.json"),
                        help="task ids to train on (AgentGym-RL-Data-ID's format)")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--n", type=int, default=8, help="episodes of a task in a group (TRL's num_generations)")
    parser.add_argument("--tasks-per-step", type=int, default=8)
    parser.add_argument("--horizon", type=int, default=6, help="turns an episode may take")
    parser.add_argument("--max-new-tokens", type=int, default=48, help="tokens a turn may sample")
    parser.add_argument("--lr", type=float, default=2e-4)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", default=None, help="write the per-step figures here as JSON")
    return parser.parse_args()


class Episode:
    """One OpenEnv session and the tokens of its episode so far."""

    def __init__(self, client, tokenizer, task_id: int):
        self.client, self.tokenizer = client, tokenizer
        first = client.reset(task_id=task_id).observation
        self.messages = [{"role": "user", "content": first["instruction"]},
                         {"role": "assistant", "content": first["ack"]},
                         {"role": "user", "content": first["text"]}]
        text = tokenizer.apply_chat_template(self.messages, tokenize=False, add_generation_prompt=True)
        self.prompt_ids = tokenizer(text, add_special_tokens=False).input_ids
        self.completion_ids: list[int] = []
        self.env_mask: list[int] = []
        self.logprobs: list[float] = []
        self.reward, self.done = 0.0, False

    def act(self, sampled: list[int], logprobs: list[float]) -> None:
        """The sampled reply to the env; its observation rendered as the next user turn (not trained)."""
        tokenizer = self.tokenizer
        ended = bool(sampled) and sampled[-1] == tokenizer.eos_token_id
        reply = tokenizer.decode(sampled, skip_special_tokens=True)
        self.completion_ids += sampled
        self.env_mask += [1] * len(sampled)
        self.logprobs += logprobs
        result = self.client.step({"text": reply})
        self.reward, self.done = float(result.observation["score"]), bool(result.done)  # (the outcome so far)
        self.messages += [{"role": "assistant", "content": "\x00"}, {"role": "user", "content": result.observation["text"]}]
        if self.done:
            return
        # the template's text after the reply: its closing (unless sampled), the observation, the next opening
        rendered = tokenizer.apply_chat_template(self.messages, tokenize=False, add_generation_prompt=True)
        tail = rendered.rsplit("\x00", 1)[1]
        if ended and tail.startswith(tokenizer.eos_token):
            tail = tail[len(tokenizer.eos_token):]
        self.messages[-2]["content"] = reply
        glue = tokenizer(tail, add_special_tokens=False).input_ids
        self.completion_ids += glue
        self.env_mask += [0] * len(glue)
        self.logprobs += [0.0] * len(glue)

    def ids(self) -> list[int]:
        return self.prompt_ids + self.completion_ids


def play(model, tokenizer, url: str, task_ids: list[int], horizon: int, max_new_tokens: int) -> list[Episode]:
    """Every episode's turns in lockstep: one batched, sampled generate a turn over the episodes still playing."""
    import torch
    from openenv.core.generic_client import GenericEnvClient

    clients = [GenericEnvClient(base_url=url).sync() for _ in task_ids]
    for client in clients:
        client.__enter__()
    try:
        episodes = [Episode(client, tokenizer, task_id) for client, task_id in zip(clients, task_ids)]
        for _ in range(horizon):
            playing = [e for e in episodes if not e.done]
            if not playing:
                break
            width = max(len(e.ids()) for e in playing)
            pad = tokenizer.pad_token_id
            input_ids = torch.tensor([[pad] * (width - len(e.ids())) + e.ids() for e in playing])
            attention = torch.tensor([[0] * (width - len(e.ids())) + [1] * len(e.ids()) for e in playing])
            with torch.no_grad():
                out = model.generate(input_ids=input_ids, attention_mask=attention, do_sample=True, temperature=1.0,
                                     top_k=0, top_p=1.0, max_new_tokens=max_new_tokens, pad_token_id=pad,
                                     eos_token_id=tokenizer.eos_token_id, output_scores=True,
                                     return_dict_in_generate=True)
            logprobs = model.compute_transition_scores(out.sequences, out.scores, normalize_logits=True)
            for row, episode in enumerate(playing):
                new = out.sequences[row, width:].tolist()
                length = new.index(tokenizer.eos_token_id) + 1 if tokenizer.eos_token_id in new else len(new)
                episode.act(new[:length], logprobs[row, :length].tolist())
        return episodes
    finally:
        for client in clients:
            client.__exit__(None, None, None)


def main() -> None:
    args = parse_args()
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    torch.manual_seed(args.seed)
    task_ids = [int(str(row["item_id"]).rpartition("_")[2]) for row in json.loads(Path(args.tasks).read_text())]
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    tokenizer.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)

    def rollout_func(prompts: list[str], trainer) -> dict:
        """TRL's prompts are task ids (each repeated num_generations times): play them all, one episode each."""
        episodes = play(trainer.model, tokenizer, args.url, [int(p) for p in prompts], args.horizon,
                        args.max_new_tokens)
        return {"prompt_ids": [e.prompt_ids for e in episodes], "completion_ids": [e.completion_ids for e in episodes],
                "logprobs": [e.logprobs for e in episodes], "env_mask": [e.env_mask for e in episodes],
                "env_reward": [e.reward for e in episodes]}

    def env_reward(completions, env_reward, **kwargs) -> list[float]:
        return env_reward

    figures: list[dict] = []

    class Figures(TrainerCallback):
        def on_step_begin(self, *a, **k):
            self.start = time.perf_counter()

        def on_log(self, _args, state, _control, logs=None, **k):
            if logs and "reward" in logs:
                figures.append({"step": state.global_step, "reward": logs["reward"],
                                "seconds": time.perf_counter() - self.start})
                print(f"step {state.global_step}: reward {logs['reward']:.3f}, {figures[-1]['seconds']:.1f} s",
                      flush=True)

    batch = args.n * args.tasks_per_step
    config = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="trl-openenv-"), report_to=[], save_strategy="no", logging_steps=1,
        max_steps=args.steps, per_device_train_batch_size=8, gradient_accumulation_steps=batch // 8,
        num_generations=args.n, learning_rate=args.lr, beta=0.0, epsilon=0.2, temperature=1.0, loss_type="dapo",
        max_completion_length=4096, mask_truncated_completions=False, lr_scheduler_type="constant", use_cpu=True,
        gradient_checkpointing=False,  # (TRL turns it on by default; generate then runs without its KV cache)
        seed=args.seed, disable_tqdm=True)
    rng = torch.Generator().manual_seed(args.seed)
    order = [task_ids[i] for i in torch.randperm(len(task_ids), generator=rng).tolist()]
    prompts = [str(order[i % len(order)]) for i in range(args.steps * args.tasks_per_step)]
    trainer = GRPOTrainer(model=model, reward_funcs=env_reward, args=config, processing_class=tokenizer,
                          train_dataset=Dataset.from_dict({"prompt": prompts}), rollout_func=rollout_func,
                          callbacks=[Figures()])
    trainer.train()
    if args.out:
        Path(args.out).write_text(json.dumps(figures, indent=1) + "\n")


if __name__ == "__main__":
    main()
