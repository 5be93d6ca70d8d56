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
5. Focus (off unless --focus-steps N): more SFT on the expert's solved episodes of BabyAI's short-horizon
   levels (envs/data/babyai_short_train.json, scripts/babyai_splits.py). Measured with N = 80 (`--from
   assets/tiny-agent`, about 10 minutes): success at T=1 on those levels' held-out tasks rose from 8% to
   about 20% (41% greedy), and on the default run's 5 levels to 40-47%; but the agent then moved more
   slowly under RL: tests/test_learning.py's bandit went 0.33 -> 0.31 with GRPO in 6 steps at lr 5e-4
   (the shipped agent: 0.27 -> 0.58), PPO collapsed at 1e-3, and the default run's held-out gain at lr
   2e-4 was +0.124, -0.057 and -0.033 over seeds 1-3. So the shipped agent has no focus step.

6. Copy phase (off unless --copy-steps N; with --from, more SFT on a built model): TextCraft's expert episodes with
   their items renamed at random (`renamed`), among fresh expert episodes of every env.

7. Where the SFT runs (--device: a GPU when there is one): --episodes DIR keeps the expert episodes (AgentTraj
   records, rl/data.py) and the tokenizer in a folder, written on the first call and read on the next, so that the
   envs play here and the SFT runs on a machine without them (--play-only here; --no-play there). --snapshots writes
   the model at those SFT steps too; the held-out NLL per action token of each env (the expert's episodes of its
   first --eval-tasks test tasks) is printed every 500 steps.

assets/tiny-generalist, the embedded agent of all five envs (issue 45; `--model tiny-generalist`, which plays 10 turns
of 64 tokens: rl/model.py's EMBEDDED_OWN), 7.35M parameters (hidden 256, 8 layers), 29 MB:

    python scripts/build_tiny_model.py --envs babyai textcraft sciworld searchqa webarena --corpus-episodes 300 \
        --sft-episodes babyai=2400 textcraft=1500 sciworld=400 searchqa=1200 webarena=44 --eval-tasks 60 \
        --horizon 10 --max-tokens 3072 --episodes .gpu/episodes --play-only                    # here: 8 minutes
    G="--envs babyai textcraft sciworld searchqa webarena --episodes .gpu/episodes --no-play --max-tokens 3072 --copies 10"
    python scripts/build_tiny_model.py $G --hidden 256 --layers 8 --lr 1e-3 --epochs 8 --snapshots 4500 --out w
    python scripts/build_tiny_model.py $G --from w-step4500 --copy-steps 1500 --copy-lr 3e-4 \
        --out assets/tiny-generalist                                                    # on an H200: 6 + 4 minutes

(the first SFT's 8 epochs are 10,224 steps, and the model is its snapshot at 4,500: the cosine schedule's rate there).
Each TextCraft episode comes with 10 renamed copies (20,446 trajectories, 19.0M tokens, 3.46M trained). The SFT took
about 10 minutes on a lent H200 (6,000 steps at 0.08-0.1 s, three such builds sharing the card); on 2 CPU cores it
would take about 13 hours (the 4-layer model's 3.9 s a step, twice the layers), which is why it is done on a GPU.
Held-out NLL per action token at the end: BabyAI 0.23, TextCraft 0.21, SciWorld 0.11, SearchQA 1.08, WebArena 0.82.
Success at T=1 within 10 turns (`eval.py --model tiny-generalist --env all --limit 60`: 60 test tasks spread over each
split, WebArena's 4): BabyAI 0.283, TextCraft 0.233 (depth 1: 0.43, depth 2: 0.22, depths 3-4: 0), SciWorld 0 (mean
score 15.5 of 100, some progress on 90% of tasks), SearchQA 0.017, WebArena 0. Its 4-layer forerunner, 450 SFT steps on
the CPU (41 minutes), learned TextCraft's 374 train goals' recipes by heart and solved no held-out one, also after three
copy phases of 250 steps; 4,500 steps with the renamed copies from the start are what taught it to read the recipes in
the prompt (the held-out TextCraft NLL: 0.33 at step 2,000, 0.21 at 4,500). Four layers learned it more slowly (held-out
TextCraft NLL 0.27 at step 4,500, success 0.067 after 7,000 steps); six and eight were close (0.19 and 0.21 at 4,500).

Everything is seeded; the output directory is written to a temporary path and renamed into place.
"""

from __future__ import annotations

import os

# torch's OpenMP threads spin while they wait for work; on a shared or small CPU that starves the env
# threads and everything else (measured here: 0.3 s vs 3.5 ms per decode step of the tiny model).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import copy
import gzip
import json
import math
import random
import re
import shutil
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import envs  # noqa: E402
from rl.data import encoded, to_record  # noqa: E402
from rl.logprobs import collate  # noqa: E402
from rl.model import EMBEDDED, EMBEDDED_ROLLOUT, load_model, load_tokenizer  # noqa: E402
from rl.sft import nll, sft_loss  # noqa: E402
from rollout import ChatFormat, ExpertEngine, HFEngine, play  # noqa: E402

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Qwen2's pre-tokenizer: words, single digits, punctuation runs, newlines and spaces kept apart.
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")
# Qwen2.5-Instruct's behaviour, written here: ChatML turns under a default system prompt; with tools, the system turn lists
# them in <tools></tools> and asks for <tool_call> blocks, a calling turn writes its calls as such blocks after its
# content, and consecutive tool results are one user turn of <tool_response> blocks (--agent tools).
CHAT_TEMPLATE = """\
{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}{%- else %}{{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}{%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}{{- "\\n" + (tool | tojson) }}{%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- elif messages[0]['role'] == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
{%- else %}
    {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message['role'] == 'system' and loop.first %}
    {%- elif message['role'] == 'assistant' and message.tool_calls %}
        {{- '<|im_start|>assistant' }}
        {%- if message['content'] %}{{- '\\n' + message['content'] }}{%- endif %}
        {%- for call in message.tool_calls %}
            {%- if call.function is defined %}{%- set call = call.function %}{%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' + call.name + '", "arguments": ' + (call.arguments | tojson) + '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message['role'] == 'tool' %}
        {%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
        {{- '\\n<tool_response>\\n' + message['content'] + '\\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}
    {%- else %}
        {{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""


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


def make_model(tokenizer, seed: int, hidden: int = 128, layers: int = 4):
    """Heads of size 32 (vLLM's CPU kernels need >= 32), half as many KV heads, an MLP 3 times as wide."""
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=3 * hidden, num_hidden_layers=layers,
        num_attention_heads=hidden // 32, num_key_value_heads=hidden // 64, head_dim=32, max_position_embeddings=32768,
        rope_theta=10000.0, tie_word_embeddings=True, bos_token_id=None,
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"), pad_token_id=tokenizer.pad_token_id,
    )
    model = Qwen2ForCausalLM(config)
    model.generation_config = GenerationConfig(eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id)
    return model


def expert_episodes(fmt, name: str, ids: list[int], horizon: int, max_tokens: int) -> list:
    """The scripted expert's episodes of these tasks, with the RL token layout (rollout.play)."""
    environments = [envs.make(name) for _ in range(min(64, len(ids)))]  # some envs are heavy (JVM, browser)
    played = play(ExpertEngine(fmt, environments), fmt, environments, ids, horizon=horizon, max_new_tokens=256,
                  max_tokens=max_tokens)
    for env in environments:
        env.close()
    return [t for t in played if t.error is None and sum(t.loss_mask) > 0]


def fit(model, tokenizer, trajectories, steps: int, lr: float, lr_factor, rng, label: str, device: str = "cpu",
        held_out: dict | None = None, snapshot=None) -> None:
    """`steps` AdamW steps of SFT on batches of 16 trajectories of about the same length (little padding: lengths
    vary 10x between envs), drawn anew and in a new order every pass; the learning rate is lr * lr_factor(step).
    On a GPU under bf16 autocast. `held_out` (env: trajectories): their NLL per action token is printed every 500
    steps and at the end; `snapshot(step)`, when given, is called after every step (--snapshots: snapshots_of)."""
    model.to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0, fused=device == "cuda")
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)
    batch_size, step, start = 16, 0, time.time()
    model.train()
    while step < steps:
        ordered = sorted(trajectories, key=lambda t: len(t.token_ids) * rng.uniform(0.9, 1.1))
        chunks = [ordered[i:i + batch_size] for i in range(0, len(ordered), batch_size)]
        rng.shuffle(chunks)
        for chunk in chunks:
            with torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda"):
                loss = sft_loss(model, on(collate(chunk, tokenizer.pad_token_id), device))
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            schedule.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            if step % 25 == 0 or step == steps:
                print(f"  {label} step {step}/{steps} loss {loss.item():.3f} ({time.time() - start:.0f}s)", flush=True)
            if held_out and (step % 500 == 0 or step == steps):
                print(f"  {label} step {step} held-out NLL per action token: " + ", ".join(
                    f"{name} {held_out_nll(model, tokenizer, rows, device):.3f}" for name, rows in held_out.items()),
                    flush=True)
            if snapshot is not None:
                snapshot(step)
            if step == steps:
                break
    model.to("cpu")


def snapshots_of(args, model, tokenizer, steps: int):
    """--snapshots: the first SFT phase's (the warm start, or with --from the copy phase) callback that writes the model
    in bf16 to OUT-stepN at those of its `steps`; a step past them stops the build before it starts."""
    if any(step > steps for step in args.snapshots):
        raise SystemExit(f"--snapshots {' '.join(map(str, args.snapshots))}: this SFT runs {steps} steps")

    def snapshot(step: int) -> None:
        if step in args.snapshots:
            out = args.out.with_name(f"{args.out.name}-step{step}")
            save(model, tokenizer, out, "bf16", args.start)
            print(f"  step {step}: wrote {out}", flush=True)
    return snapshot


def on(batch: dict, device: str) -> dict:
    return {key: value.to(device) for key, value in batch.items()}


@torch.no_grad()
def held_out_nll(model, tokenizer, trajectories, device: str) -> float:
    """The mean NLL per action token of `trajectories` (an env's held-out expert episodes)."""
    model.eval()
    total = tokens = 0.0
    for i in range(0, len(trajectories), 16):
        batch = on(collate(trajectories[i:i + 16], tokenizer.pad_token_id), device)
        with torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda"):
            total += nll(model, batch["input_ids"], batch["attention_mask"], batch["loss_mask"]).item()
        tokens += batch["loss_mask"].sum().item()
    model.train()
    return total / max(tokens, 1.0)


def played(fmt, episodes: dict[str, int], split: str, horizon: int, max_tokens: int, seed: int) -> dict[str, list]:
    """The scripted expert's episodes as AgentTraj records (rl/data.py), per env: `episodes[env]` tasks of its train
    split drawn with replacement (small splits repeat), or the first `episodes[env]` of its test split."""
    rng, records = random.Random(seed + 1), {}
    for name, count in episodes.items():
        started, tasks = time.time(), envs.splits(name)[split]
        ids = rng.choices(tasks, k=count) if split == "train" else tasks[:count]
        records[name] = [to_record(t) for t in expert_episodes(fmt, name, ids, horizon, max_tokens)]
        print(f"  {name} {split}: {len(records[name])} expert episodes ({time.time() - started:.0f}s)", flush=True)
    return records


def encoded_episodes(fmt, rows: list[dict], max_tokens: int) -> list:
    """Records as RL's token layout (what fit takes)."""
    out = []
    for record in rows:
        ids, mask = encoded(fmt, record, max_tokens)
        out.append(SimpleNamespace(token_ids=ids, loss_mask=mask, logprobs=[0.0] * len(ids)))
    return out


def sft_set(fmt, records: dict[str, list], copies: int, rng, max_tokens: int) -> list:
    """Every env's records, with `copies` renamed variants of each TextCraft one (renamed)."""
    out = []
    for name, rows in records.items():
        out += encoded_episodes(fmt, rows, max_tokens)
        if name == "textcraft" and copies:
            out += renamed(rows, fmt, copies, rng, max_tokens)
    print(f"SFT set: {len(out)} trajectories, {sum(len(t.token_ids) for t in out)} tokens "
          f"({sum(sum(t.loss_mask) for t in out)} action tokens)", flush=True)
    return out


def save_episodes(folder: Path, tokenizer, train: dict, test: dict, played_under: dict) -> None:
    """--episodes: the tokenizer, the records (episodes.jsonl.gz: a line per episode with its env and split) and what
    they were played under (play.json: --horizon, --max-tokens)."""
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tokenizer.save_pretrained(tmp)
    (tmp / "play.json").write_text(json.dumps(played_under) + "\n")
    with gzip.open(tmp / "episodes.jsonl.gz", "wt") as out:
        for split, records in (("train", train), ("test", test)):
            for name, rows in records.items():
                for record in rows:
                    out.write(json.dumps({"env": name, "split": split, "record": record}) + "\n")
    shutil.rmtree(folder, ignore_errors=True)
    tmp.rename(folder)


def load_episodes(folder: Path) -> tuple:
    """What save_episodes wrote: the tokenizer, the train and test records per env, and what they were played under."""
    splits = {"train": {}, "test": {}}
    with gzip.open(folder / "episodes.jsonl.gz", "rt") as lines:
        for line in lines:
            row = json.loads(line)
            splits[row["split"]].setdefault(row["env"], []).append(row["record"])
    played_under = json.loads((folder / "play.json").read_text()) if (folder / "play.json").is_file() else {}
    return load_tokenizer(str(folder)), splits["train"], splits["test"], played_under


def save(model, tokenizer, out: Path, dtype: str = "fp32", tokenizer_from: Path | None = None) -> None:
    """The model (in `dtype`) and its tokenizer, written to a temporary folder and renamed into place."""
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    (copy.deepcopy(model).to("cpu", torch.bfloat16) if dtype == "bf16" else model).save_pretrained(tmp)
    if tokenizer_from is None:
        tokenizer.save_pretrained(tmp)
    else:  # the tokenizer as it was, byte for byte (saving a loaded one rewrites its files)
        for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
            shutil.copy(tokenizer_from / name, tmp / name)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)


def focus(model, tokenizer, task_file: Path, steps: int, lr: float, horizon: int, max_tokens: int,
          device: str = "cpu") -> None:
    """More SFT on the solved expert episodes of BabyAI's short-horizon levels (seeds 3-102), at a constant
    rate after 10 warm-up steps (see step 5 of the module's docstring)."""
    ids = envs.load_task_ids(task_file, "babyai")
    trajectories = [t for t in expert_episodes(ChatFormat(tokenizer), "babyai", ids, horizon, max_tokens) if t.success]
    print(f"focus: {len(trajectories)} solved expert episodes of {len(ids)} tasks in {task_file.name}")
    fit(model, tokenizer, trajectories, steps, lr, lambda s: min(1.0, (s + 1) / 10), random.Random(0), "focus", device)


COMMAND = re.compile(r"^craft \d+ (.+?) using (.+)$", re.M)
GOAL = re.compile(r"Goal: craft (.+?)\.")


def textcraft_items(prompts: list[str]) -> list[str]:
    """Every item name in TextCraft's first observations (`prompts`): its crafting commands' and goal's (`birch log`)."""
    items = set()
    for first in prompts:
        for target, inputs in COMMAND.findall(first):
            items |= {target} | {part.strip().split(" ", 1)[1] for part in inputs.split(",")}
        items |= set(GOAL.findall(first))
    return sorted(items)


def renamed(records: list[dict], fmt, copies: int, rng, max_tokens: int) -> list:
    """`copies` variants of each TextCraft record with its items renamed at random, consistently through every
    message (`birch log` and `minecraft:birch_log` alike), in RL's token layout: the goal, the recipes and the
    expert's actions then name items whose recipes the model has never seen, so it can only act by copying them from
    the prompt. TextCraft has 374 train goals; on those alone the model learns each goal's recipe by heart and fails
    every held-out goal."""
    items = textcraft_items([record["conversations"][2]["value"] for record in records])
    out = []
    for record in records:
        own = textcraft_items([record["conversations"][2]["value"]])
        if not own:
            continue
        for _ in range(copies):
            names = dict(zip(own, rng.sample(items, len(own))))
            names |= {a.replace(" ", "_"): b for a, b in list(names.items()) if " " in a}
            pattern = re.compile(r"(minecraft:)?\b(" + "|".join(map(re.escape, sorted(names, key=len, reverse=True)))
                                 + r")\b")
            turns = [{**turn, "value": pattern.sub(new_name(names), turn["value"])} if k >= 2 else turn
                     for k, turn in enumerate(record["conversations"])]
            out += encoded_episodes(fmt, [{**record, "conversations": turns}], max_tokens)
    return out


def new_name(names: dict[str, str]):
    """renamed's replacement of a match: the item's new name, as the env writes it (`minecraft:oak_planks` where
    the match was an id, `oak planks` in text)."""
    def replace(match) -> str:
        name = names[match.group(2)]
        return "minecraft:" + name.replace(" ", "_") if match.group(1) else name
    return replace


def copy_phase(model, tokenizer, records: dict[str, list], copies: int, steps: int, lr: float, max_tokens: int,
               seed: int, device: str, held_out: dict, snapshot=None) -> None:
    """More SFT from a built model: renamed TextCraft episodes (renamed) among the expert episodes of every env (so
    that it keeps them), at a constant rate after 20 warm-up steps."""
    rng = random.Random(seed + 2)
    fit(model, tokenizer, sft_set(ChatFormat(tokenizer), records, copies, rng, max_tokens), steps, lr,
        lambda s: min(1.0, (s + 1) / 20), rng, "copy", device, held_out, snapshot)


def evaluate(model, fmt, env_name, task_ids, horizon, max_new_tokens, max_tokens):
    environments = [envs.make(env_name) for _ in range(min(32, len(task_ids)))]  # some envs are heavy (JVM, browser)
    engine = HFEngine(model, fmt, temperature=1.0, seed=0)
    trajectories = play(engine, fmt, environments, task_ids, horizon=horizon, max_new_tokens=max_new_tokens,
                        max_tokens=max_tokens)
    for env in environments:
        env.close()
    return sum(t.success for t in trajectories) / len(trajectories), sum(t.reward for t in trajectories) / len(trajectories)


def episode_counts(names: list[str], counts: list[str]) -> dict[str, int]:
    """--sft-episodes: one count for every env, or ENV=N entries (envs not named get the plain count, or 2000)."""
    try:
        plain = [int(c) for c in counts if "=" not in c]
        named = {key: int(value) for key, value in (c.split("=", 1) for c in counts if "=" in c)}
    except ValueError:
        named, plain = {"": 0}, []
    if set(named) - set(names) or len(plain) > 1 or min([*plain, *named.values()], default=1) < 1:
        raise SystemExit(f"--sft-episodes: give one count, or ENV=N for envs of --envs ({', '.join(names)}), each at "
                         "least 1")
    return {name: named.get(name, plain[0] if plain else 2000) for name in names}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=EMBEDDED["tiny-agent"])
    parser.add_argument("--from", dest="start", type=Path, help="skip steps 1-4: focus this model (and tokenizer)")
    parser.add_argument("--envs", nargs="+", default=["babyai"])
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--corpus-episodes", type=int, default=1000)
    parser.add_argument("--sft-episodes", nargs="+", default=["2000"], help="per env: N, or ENV=N entries")
    parser.add_argument("--hidden", type=int, default=128, help="the model's width (a multiple of 64)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=48, help="a reply's budget in the final evaluation")
    parser.add_argument("--eval-tasks", type=int, default=120,
                        help="the first N tasks of each env's test split: the held-out NLL and the evaluation; 0: none")
    parser.add_argument("--horizon", type=int, default=6, help="the tiny preset's horizon")
    parser.add_argument("--max-tokens", type=int, default=2048, help="token budget of an expert episode")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--focus-tasks", type=Path, default=envs.DATA_DIR / "babyai_short_train.json")
    parser.add_argument("--focus-steps", type=int, default=0, help="SFT steps of step 5; 0: none")
    parser.add_argument("--focus-lr", type=float, default=1e-3)
    parser.add_argument("--copies", type=int, default=0, help="renamed variants of each TextCraft episode in the SFT")
    parser.add_argument("--copy-steps", type=int, default=0, help="SFT steps of the copy phase (renamed TextCraft); 0: none")
    parser.add_argument("--copy-lr", type=float, default=1e-3)
    parser.add_argument("--episodes", type=Path, help="a folder for the expert episodes and the tokenizer: written "
                        "there when it has none, read from there when it has (play them here, fit on a GPU elsewhere)")
    parser.add_argument("--no-play", action="store_true", help="fit only, from --episodes: no env is made (the "
                        "final evaluation is left out), for a machine without the envs")
    parser.add_argument("--play-only", action="store_true", help="write --episodes and stop")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="where SFT runs")
    parser.add_argument("--snapshots", type=int, nargs="*", default=[],
                        help="SFT steps at which the model is also written, in bf16, to OUT-stepN")
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32", help="of the written weights")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    have = args.episodes is not None and (args.episodes / "episodes.jsonl.gz").is_file()
    if (args.play_only and args.episodes is None) or (args.no_play and not have):
        raise SystemExit("--play-only needs --episodes DIR; --no-play needs --episodes DIR with episodes written")
    if args.copy_steps and not args.copies:
        raise SystemExit("--copy-steps needs --copies N (renamed variants of each TextCraft episode)")
    if args.play_only and have:
        raise SystemExit(f"{args.episodes} holds episodes already: --play-only writes a new folder")
    if args.no_play and args.focus_steps:
        raise SystemExit("--focus-steps plays BabyAI's experts, which --no-play leaves out")
    torch.set_num_threads(max(1, torch.get_num_threads()))
    random.seed(args.seed)

    start = time.time()
    if have:
        tokenizer, train, test, played_under = load_episodes(args.episodes)
        if args.max_tokens < played_under.get("max_tokens", 0):
            raise SystemExit(f"{args.episodes} was played under --max-tokens {played_under['max_tokens']}: fit with "
                             "as many (fewer would cut its episodes)")
        if set(args.envs) - set(train):
            raise SystemExit(f"{args.episodes} has no episodes of {', '.join(sorted(set(args.envs) - set(train)))}")
        train, test = ({n: rows[n] for n in args.envs if n in rows} for rows in (train, test))
        print(f"episodes: read from {args.episodes}")
    else:
        tokenizer = load_tokenizer(str(args.start)) if args.start else train_tokenizer(
            expert_texts(args.envs, args.corpus_episodes, args.seed), args.vocab_size)
        print(f"tokenizer: {len(tokenizer)} tokens ({time.time() - start:.0f}s)")
        fmt = ChatFormat(tokenizer)
        train = played(fmt, episode_counts(args.envs, args.sft_episodes), "train", args.horizon, args.max_tokens,
                       args.seed)
        test = played(fmt, dict.fromkeys(args.envs, args.eval_tasks), "test", args.horizon, args.max_tokens,
                      args.seed) if args.eval_tasks else {}
        if args.episodes:
            save_episodes(args.episodes, tokenizer, train, test, {"horizon": args.horizon, "max_tokens": args.max_tokens})
            print(f"episodes: wrote {args.episodes}")
    if args.play_only:
        return
    if args.start is not None:  # (the model's own tokenizer, whatever --episodes holds)
        tokenizer = load_tokenizer(str(args.start))
    fmt = ChatFormat(tokenizer)
    held_out = {name: encoded_episodes(fmt, rows, args.max_tokens) for name, rows in test.items()}
    if args.start is None:
        model = make_model(tokenizer, args.seed, args.hidden, args.layers)
        print(f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters")
        rng = random.Random(args.seed + 1)
        trajectories = sft_set(fmt, train, args.copies, rng, args.max_tokens)
        steps = args.epochs * math.ceil(len(trajectories) / 16)
        fit(model, tokenizer, trajectories, steps, args.lr,
            lambda s: min(1.0, (s + 1) / 50) * 0.5 * (1 + math.cos(math.pi * s / steps)), rng, "warm start",
            args.device, held_out, snapshots_of(args, model, tokenizer, steps) if args.snapshots else None)
    else:
        model = load_model(str(args.start))
    if args.copy_steps:
        later = args.start is None or not args.snapshots  # (the snapshots are the first phase's)
        copy_phase(model, tokenizer, train, args.copies, args.copy_steps, args.copy_lr, args.max_tokens, args.seed,
                   args.device, held_out, None if later else snapshots_of(args, model, tokenizer, args.copy_steps))
    elif args.snapshots and args.start is not None:
        raise SystemExit("--snapshots are of an SFT: with --from, of the copy phase (--copy-steps)")
    tests = {name: envs.splits(name)["test"][:args.eval_tasks] for name in args.envs} if args.eval_tasks else {}
    if args.focus_steps:
        focus(model, tokenizer, args.focus_tasks, args.focus_steps, args.focus_lr, args.horizon,
              EMBEDDED_ROLLOUT["max_tokens"], args.device)
        tests = {"babyai": envs.load_task_ids(str(args.focus_tasks).replace("_train", "_test"), "babyai")}
    save(model, tokenizer, args.out, args.dtype, args.start)  # (before the evaluation: it only reports)
    for name, tasks in ({} if args.no_play else tests).items():
        success, reward = evaluate(model, fmt, name, tasks, args.horizon, args.max_new_tokens, args.max_tokens)
        print(f"{name} test ({len(tasks)} tasks, {args.horizon} turns, T=1): success {success:.3f}, mean reward "
              f"{reward:.3f}", flush=True)
    print(f"wrote {args.out} in {time.time() - start:.0f}s")


if __name__ == "__main__":
    main()
