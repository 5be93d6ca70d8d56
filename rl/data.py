"""AgentGym's trajectory format (AgentTraj), read and written, and turned into RL's token layout.

    records = read_trajectories("babyai_train.jsonl")       # AgentTraj-L JSON or JSONL, or ours
    ids, mask = encode(fmt, records[0])                     # exactly the tokens and mask of an RL rollout
    record = to_record(trajectory)                          # a rollout (ours) as an AgentTraj record

A record is one episode, as in AgentGym's AgentTraj files:

    {"item_id": "babyai_12",
     "conversations": [{"from": "human", "loss": null, "value": <instruction>},
                       {"from": "gpt", "loss": false, "value": <the canned ack>},
                       {"from": "human", "loss": null, "value": <first observation>},
                       {"from": "gpt", "loss": true, "value": <the agent's reply>}, ...],
     "reward": 0.95}

An episode played with native tool calls (--agent tools) also holds the tools it was given ("tools": OpenAI
function schemas, rendered into its first prompt) and its env's answers as "tool" turns (tool results).

Fields beyond these are ignored; "reward" may be missing (AgentTraj-L has none). Our own rollout logs
and eval outputs (rollouts.jsonl, eval_*.jsonl: "messages" with roles) read as records too. Task-id files
(AgentGym-RL-Data-ID, `[{"item_id": "babyai_12"}, ...]`) are read by envs.load_task_ids.

Tokens: the first three messages are the prompt an RL rollout starts from (ChatFormat.prompt), each
later "gpt" turn is its text's tokens plus the end-of-turn token, and each later "human" turn is an
observation wrapped in the template's scaffolding (ChatFormat.observation); a final observation is
dropped, as a rollout does. The loss mask is 1 on a "gpt" turn after the ack unless its "loss" is
false (null counts as trained, as AgentGym's trainer treats every agent turn after the first), and 0
everywhere else: so an expert episode and the same episode sampled in RL give identical ids and mask.

train.py reads --data with `read_data` and holds out a seeded share of its tasks (`held_out`) for a validation
loss; AgentGym trains on every record and only evaluates by playing.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from rl.chat import CallError
from rl.dpo import expert_pairs, make_pairs
from rl.trajectory import Trajectory

ROLES = {"human": "user", "gpt": "assistant", "tool": "tool"}  # ("tool": an env's answer to a native tool call)


class DataError(ValueError):
    """A trajectory file or record that cannot be used; the message names which and why."""


@dataclass
class OfflineArgs:
    """What train.py's sft, dpo and agentevol learn from and how (their flags, nested in its Args under their own
    names)."""

    data: tuple[str, ...] = ()
    """trajectory files to learn from: AgentGym's AgentTraj JSON/JSONL (scripts/make_expert_data.py writes
    them), a run's rollouts.jsonl or eval.py's episodes"""
    experience: tuple[str, ...] = ()
    """dpo: the model's own episodes, each paired (rejected) with its task's episode in --data (chosen),
    as AgentGym's make_dpo_dataset; without it, pairs are made within --data's tasks"""
    batch_size: int = 16
    """conversations (dpo: pairs) per optimizer step"""
    validation: float = 0.05
    """share of --data's tasks held out for the validation loss"""
    beta: float = 0.5
    """dpo: strength of the pull toward the reference model (AgentGym's train_dpo.sh: 0.5)"""
    margin: float = 0.5
    """dpo: a pair's chosen episode scored at least this much more than its rejected one"""
    iterations: int = 2
    """agentevol: rounds of explore, keep the successes, retrain, evaluate, after a first round of behaviour
    cloning on --data alone"""
    explore_tasks: int = 0
    """agentevol: train tasks of each env explored per iteration (--n episodes each), spread over its split; 0: all"""
    threshold: float | None = None
    """agentevol: keep explored episodes with at least this reward; default: those the env counts as solved"""
    retrain_from: Literal["base", "continue"] = "base"
    """agentevol: each iteration retrains --model afresh on the merged data (base, as AgentGym), or goes on
    from the last iteration's weights (continue)"""

    def check(self, algo: str, world: int) -> None:
        """Stop early, with what to do, on settings of --algo `algo` over `world` processes that cannot work."""
        if not self.data:
            raise SystemExit(f"--algo {algo} learns from trajectory files: give --data FILE ... (AgentGym's AgentTraj "
                             "format; `python scripts/make_expert_data.py --env ENV` writes the oracle's, and a run's "
                             "rollouts.jsonl or eval.py's episodes read too)")
        if self.experience and algo != "dpo":
            raise SystemExit("--experience holds the rejected side of DPO's pairs: use it with --algo dpo")
        if self.batch_size < 1 or self.batch_size % world:
            raise SystemExit(f"--batch-size {self.batch_size} must be at least 1 and divisible by the {world} processes")
        if not 0 <= self.validation < 1:
            raise SystemExit("--validation is the share of --data's tasks held out, in [0, 1)")
        if self.beta <= 0 or self.margin < 0:
            raise SystemExit("--beta must be above 0 and --margin at least 0")
        if self.iterations < 1 or self.explore_tasks < 0:
            raise SystemExit("--iterations takes 1 or more, --explore-tasks 0 (all) or more")


def read_trajectories(path: str | Path) -> list[dict]:
    """Every record of an AgentTraj file (a JSON list, or JSON lines), checked; a malformed one stops
    with its file, position, item id and what is wrong."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"trajectory file {path} does not exist")
    text = path.read_text()
    try:
        records = json.loads(text) if text.lstrip().startswith("[") else [
            json.loads(line) for line in text.splitlines() if line.strip()]
    except json.JSONDecodeError as error:
        raise DataError(f"{path}: not JSON or JSON lines ({error})") from None
    records = [from_log(r) if _logged(r) else r for r in records
               if not (_logged(r) and r.get("error"))]  # an env failure in a log has no outcome to learn from
    for index, record in enumerate(records):
        problem = _problem(record)
        if problem:
            item = record.get("item_id") if isinstance(record, dict) else None
            raise DataError(f"{path}: record {index}" + (f" ({item})" if item else "") + f": {problem}")
    return records


def _logged(record) -> bool:
    """A line of our rollout log or eval output rather than an AgentTraj record."""
    return isinstance(record, dict) and "messages" in record and "conversations" not in record


def _problem(record) -> str | None:
    """What is wrong with a record, or None."""
    if not isinstance(record, dict):
        return f"a record is a JSON object, not {type(record).__name__}"
    if not isinstance(record.get("item_id"), str) or "_" not in record["item_id"]:
        return 'needs "item_id" as "<env>_<number>", e.g. "babyai_12"'
    if not record["item_id"].rpartition("_")[2].isdigit():
        return f'item_id {record["item_id"]!r} does not end in a task number'
    turns = record.get("conversations")
    if not isinstance(turns, list) or len(turns) < 3:
        return 'needs "conversations": the instruction, the ack and at least one observation'
    for k, turn in enumerate(turns):
        expected = "human" if k % 2 == 0 else "gpt"
        if not isinstance(turn, dict) or turn.get("from") not in ((expected, "tool") if k > 2 and k % 2 == 0 else (expected,)):
            return f'conversations[{k}] must be a "{expected}" turn (turns alternate, starting with "human")'
        if not isinstance(turn.get("value"), str):
            return f'conversations[{k}] needs a string "value"'
        if turn.get("loss") not in (None, True, False):
            return f'conversations[{k}]: "loss" is true, false or null, not {turn["loss"]!r}'
    if record.get("reward") is not None and not isinstance(record["reward"], (int, float)):
        return f'"reward" is a number, not {record["reward"]!r}'
    return None


def encode(fmt, record: dict) -> tuple[list[int], list[int]]:
    """A record's token ids and loss mask, laid out exactly as an RL rollout of the same episode."""
    turns = record["conversations"]
    messages = [{"role": ROLES[t["from"]], "content": t["value"]} for t in turns[:3]]
    ids = fmt.prompt(messages, tools=record.get("tools"))
    mask = [0] * len(ids)
    for k, turn in enumerate(turns[3:], start=3):
        if turn["from"] == "gpt":
            reply = fmt.encode(written(fmt, turn)) + [fmt.end_of_turn]
            ids += reply
            mask += [int(turn.get("loss") is not False)] * len(reply)
        elif k < len(turns) - 1:  # an observation the agent answered (a final one is not tokenized)
            observation = fmt.observation(turn["value"], ROLES[turn["from"]])
            ids += observation
            mask += [0] * len(observation)
    return ids, mask


def written(fmt, turn: dict) -> str:
    """An agent turn's text as the model writes it: its value, and a call an API server returned apart from the
    text (tool_calls, with no call in the value) written in the template's format after it."""
    calls = turn.get("tool_calls") or []
    if not calls or fmt.call_style is None:
        return turn["value"]
    try:
        if fmt.parse_calls(fmt.answer(turn["value"]) or ""):  # (a local model's reply: its calls are in its text)
            return turn["value"]
    except CallError:
        return turn["value"]
    written_calls = [fmt.call_text(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]
    return "\n".join([turn["value"]] * bool(turn["value"]) + written_calls)


def to_record(trajectory: Trajectory) -> dict:
    """A rollout's episode as an AgentTraj record (its messages: instruction, ack, then turns)."""
    return from_log({"item_id": trajectory.item_id, "messages": trajectory.messages, "reward": trajectory.reward,
                     "tools": trajectory.tools})


def from_log(entry: dict) -> dict:
    """A line of a rollout log or eval output (item_id, messages with roles, reward, ...) as a record."""
    conversations = []
    for k, message in enumerate(entry["messages"]):
        agent = message.get("role") == "assistant"
        conversations.append({"from": "gpt" if agent else "tool" if message.get("role") == "tool" else "human",
                              "loss": (k > 1) if agent else None, "value": message.get("content") or "",
                              **({"tool_calls": message["tool_calls"]} if message.get("tool_calls") else {})})
    return {"item_id": entry.get("item_id"), "conversations": conversations, "reward": entry.get("reward"),
            **({"tools": entry["tools"]} if entry.get("tools") else {})}


def read_data(paths: tuple[str, ...], env: str | tuple[str, ...], agent: str = "react", every: bool = True
              ) -> list[dict]:
    """Every record of the trajectory files, which must all be episodes of the run's env (or envs: then, with
    `every`, some of each), played with tool calls exactly when `agent` is tools (the layout they are learnt in is
    the one the run's evaluations play)."""
    names = (env,) if isinstance(env, str) else tuple(env)
    records = []
    for path in paths:
        try:
            records += read_trajectories(path)
        except DataError as error:
            raise SystemExit(f"--data: {error}") from None
    called = sum(bool(r.get("tools")) for r in records)
    if called and agent != "tools":
        raise SystemExit(f"{', '.join(paths)} hold {called} episodes played with tool calls: add --agent tools, so that "
                         "the run plays (and evaluates) as it learns")
    if agent == "tools" and called < len(records):
        raise SystemExit(f"--agent tools learns episodes of tool calls, and {len(records) - called} in {', '.join(paths)} "
                         "are ReAct text: make them with scripts/make_expert_data.py --agent tools, or leave out "
                         "--agent tools")
    held = {r["item_id"].rpartition("_")[0] for r in records}
    others = sorted(held - set(names))
    if others and len(names) == 1:
        raise SystemExit(f"{', '.join(paths)} hold episodes of {', '.join(others)}, and the run's env is {names[0]}: "
                         f"pass --env {others[0]}, or give {names[0]}'s episodes")
    if others:
        raise SystemExit(f"{', '.join(paths)} hold episodes of {', '.join(others)}, which the run's --env "
                         f"({' '.join(names)}) leaves out: add them to --env, or leave their episodes out")
    missing = [name for name in names if name not in held]
    if every and len(names) > 1 and missing:
        raise SystemExit(f"{', '.join(paths)} hold no episode of {', '.join(missing)}: give some (scripts/"
                         f"make_expert_data.py --env {missing[0]}), or leave {missing[0]} out of --env")
    return records


def held_out(records: list[dict], share: float, seed: int) -> tuple[list[dict], list[dict]]:
    """(train, validation): a seeded `share` of the tasks, with every episode of each, held out, so that
    the validation loss is on tasks the model never learned from."""
    tasks = sorted({r["item_id"] for r in records})
    chosen = set(random.Random(f"{seed}-validation").sample(tasks, round(share * len(tasks))))
    return [r for r in records if r["item_id"] not in chosen], [r for r in records if r["item_id"] in chosen]


def examples_of(fmt, records: list[dict], max_tokens: int, pairs: bool = False, margin: float = 0.0,
                experience: list[dict] | None = None) -> list:
    """What an optimizer step of train.py draws from: (ids, mask) conversations with a trained token (sft,
    agentevol), or with `pairs` (dpo) (chosen, rejected) pairs of them, their rewards at least `margin` apart
    (rl/dpo.py: within --data's tasks, or --data's expert episodes against the model's own `experience`)."""
    if not pairs:
        sequences = [encoded(fmt, r, max_tokens) for r in records]
        return [s for s in sequences if any(s[1])]
    pairs = expert_pairs(records, experience, margin) if experience is not None else make_pairs(records, margin)
    return [(encoded(fmt, chosen, max_tokens), encoded(fmt, rejected, max_tokens)) for chosen, rejected in pairs]


def offline_steps(examples: int, batch_size: int, epochs: int | None, steps: int, pairs: bool = False) -> int:
    """Optimizer steps of train.py's sft or dpo run (agentevol: of each iteration) over `examples` conversations or
    (`pairs`, dpo) pairs: `epochs` passes (the last incomplete batch dropped, as RL's task order), else `steps`."""
    if examples < batch_size:
        raise SystemExit(f"{examples} training {'pairs' if pairs else 'conversations'} are fewer than "
                         f"--batch-size {batch_size}: lower it, or give more --data"
                         + (" (or a lower --margin)" if pairs else ""))
    return epochs * (examples // batch_size) if epochs is not None else steps


def encoded(fmt, record: dict, max_tokens: int) -> tuple[list[int], list[int]]:
    """A record as RL's token ids and loss mask (rl/data.py: encode), cut to --max-tokens as a rollout
    would be: what does not fit is not learned."""
    ids, mask = encode(fmt, record)
    return ids[:max_tokens], mask[:max_tokens]
