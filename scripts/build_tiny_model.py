"""Build the embedded default model, assets/tiny-agent: what `python train.py` runs with no flags.

    python scripts/build_tiny_model.py          # about 20 minutes on 2 idle CPU cores

1. Corpus: episodes of the envs' scripted experts (envs.oracle) on their train splits.
2. Tokenizer: byte-level BPE trained on that text (Qwen2's pre-tokenizer regex, NFC, 4096 tokens)
   with Qwen's special tokens and ChatML chat template, default system prompt included, so the
   tiny model formats conversations exactly as Qwen2.5-Instruct does.
3. Model: Qwen2 architecture, 4 layers, hidden 128, 4 attention heads of size 32 (vLLM's CPU
   kernels need head size >= 32), 2 KV heads, tied embeddings, 0.85M parameters (the vocabulary
   is small: environment text has few distinct words). Twice the width did not do better here.
4. Warm start: SFT on expert episodes cut to the default preset's horizon, so that RL starts from
   a policy that answers in the "Thought/Action" format and sometimes succeeds; from random
   weights every reward would be 0 and GRPO would have nothing to learn from.

Everything is seeded; the output directory is written to a temporary path and renamed into place.
"""

from __future__ import annotations

import os

# torch's OpenMP threads spin while they wait for work; on a shared or small CPU that starves the env
# threads and everything else (measured here: 0.3 s vs 3.5 ms per decode step of the tiny model).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import math
import random
import shutil
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import envs  # noqa: E402
from rl.logprobs import collate  # noqa: E402
from rl.model import EMBEDDED  # noqa: E402
from rl.sft import sft_loss  # noqa: E402
from rollout import ChatFormat, ExpertEngine, HFEngine, play, rollout  # noqa: E402

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Qwen2's pre-tokenizer: words, single digits, punctuation runs, newlines and spaces kept apart.
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")
CHAT_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if not (loop.first and message['role'] == 'system') %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def expert_texts(env_names: list[str], episodes: int, seed: int) -> list[str]:
    """Every message of `episodes` expert episodes per env, for tokenizer training."""
    texts = []
    rng = random.Random(seed)
    for name in env_names:
        env = envs.make(name)
        texts += [env.instruction, env.ack]
        train = envs.splits(name)["train"]
        for task_id in rng.sample(train, min(episodes, len(train))):
            observation = env.reset(task_id)
            try:
                expert = envs.oracle(env)
                for _ in range(64):
                    response = expert(observation)
                    texts += [observation, response]
                    result = env.step(response)
                    observation = result.observation
                    if result.done:
                        break
            except RuntimeError:  # a task the expert cannot play
                continue
            texts.append(observation)
        env.close()
    return texts


def train_tokenizer(texts: list[str], vocab_size: int):
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                 extra_special_tokens=["<|im_start|>", "<|im_end|>"], model_max_length=32768)
    hf.chat_template = CHAT_TEMPLATE
    return hf


def make_model(tokenizer, seed: int):
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=128, intermediate_size=384, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=32768,
        rope_theta=10000.0, tie_word_embeddings=True, bos_token_id=None,
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"), pad_token_id=tokenizer.pad_token_id,
    )
    model = Qwen2ForCausalLM(config)
    model.generation_config = GenerationConfig(eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id)
    return model


def warm_start(model, tokenizer, env_names, episodes, horizon, max_tokens, epochs, lr, seed):
    fmt = ChatFormat(tokenizer)
    trajectories = []
    rng = random.Random(seed + 1)
    for name in env_names:
        ids = rng.choices(envs.splits(name)["train"], k=episodes)  # with replacement: small splits repeat
        environments = [envs.make(name) for _ in range(min(64, len(ids)))]  # some envs are heavy (JVM, browser)
        played = play(ExpertEngine(fmt, environments), fmt, environments, ids, horizon=horizon, max_new_tokens=256,
                      max_tokens=max_tokens)
        trajectories += [t for t in played if t.error is None and sum(t.loss_mask) > 0]
        for env in environments:
            env.close()
    tokens = sum(len(t.token_ids) for t in trajectories)
    print(f"warm start: {len(trajectories)} expert trajectories, {tokens} tokens "
          f"({sum(sum(t.loss_mask) for t in trajectories)} action tokens)")

    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    batch_size = 16
    steps = epochs * math.ceil(len(trajectories) / batch_size)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 50) * 0.5 * (1 + math.cos(math.pi * s / steps)))
    model.train()
    step, start = 0, time.time()
    for epoch in range(epochs):
        rng.shuffle(trajectories)
        # similar lengths together: less padding
        chunks = [trajectories[i:i + batch_size] for i in range(0, len(trajectories), batch_size)]
        for chunk in chunks:
            batch = collate(chunk, tokenizer.pad_token_id)
            loss = sft_loss(model, batch)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            schedule.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            if step % 25 == 0 or step == steps:
                print(f"  epoch {epoch + 1} step {step}/{steps} loss {loss.item():.3f} ({time.time() - start:.0f}s)", flush=True)
    return fmt


def evaluate(model, fmt, env_name, task_ids, horizon, max_tokens):
    environments = [envs.make(env_name) for _ in task_ids]
    engine = HFEngine(model, fmt, temperature=1.0, seed=0)
    trajectories = rollout(engine, fmt, environments, task_ids, list(range(len(task_ids))),
                           horizon=horizon, max_new_tokens=48, max_tokens=max_tokens)
    return sum(t.success for t in trajectories) / len(trajectories), sum(t.reward for t in trajectories) / len(trajectories)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=EMBEDDED["tiny-agent"])
    parser.add_argument("--envs", nargs="+", default=["babyai"])
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--corpus-episodes", type=int, default=1000)
    parser.add_argument("--sft-episodes", type=int, default=2000)
    parser.add_argument("--horizon", type=int, default=6, help="the tiny preset's horizon")
    parser.add_argument("--max-tokens", type=int, default=2048, help="token budget of an expert episode")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    random.seed(args.seed)

    start = time.time()
    tokenizer = train_tokenizer(expert_texts(args.envs, args.corpus_episodes, args.seed), args.vocab_size)
    print(f"tokenizer: {len(tokenizer)} tokens ({time.time() - start:.0f}s)")
    model = make_model(tokenizer, args.seed)
    print(f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters")
    fmt = warm_start(model, tokenizer, args.envs, args.sft_episodes, args.horizon, args.max_tokens,
                     args.epochs, args.lr, args.seed)
    test = envs.splits(args.envs[0])["test"]
    success, reward = evaluate(model, fmt, args.envs[0], test, args.horizon, args.max_tokens)
    print(f"{args.envs[0]} test ({len(test)} tasks, {args.horizon} turns, T=1): success {success:.3f}, mean reward {reward:.3f}")

    tmp = args.out.with_name(args.out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    shutil.rmtree(args.out, ignore_errors=True)
    tmp.rename(args.out)
    print(f"wrote {args.out} in {time.time() - start:.0f}s")


if __name__ == "__main__":
    main()
