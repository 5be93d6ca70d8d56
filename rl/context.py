"""--context: what a turn's prompt holds of the episode so far, for long horizons (issue 46).

    context = Context.parse("window:4")                    # full | window:K
    traj.kept = context.first_kept(len(traj.messages), traj.opening)   # then traj.prompt_messages()

full (the default): every turn's prompt is the whole episode, one sequence that each turn extends by its sampled
tokens and the observation (rollout.py's token-in-token-out). At 30 turns, or with WebArena's pages, it grows until
the token budget ends the episode.

window:K: the opening (the instruction, the agent's acknowledgement and the first observation, which states the
task) and the last K turns, each an assistant reply and the env's answer to it; older turns are dropped. The prompt
stops growing after K turns (verl-agent's memory module keeps ALFWorld's prompts flat the same way).

Segments. Where the history changes (a window slides: every turn after the K-th), the next turn starts a new sequence,
a segment, whose prompt is the chat template's own rendering of the kept messages (ChatFormat.prompt), as --reasoning
drop does every turn; within a segment each turn extends the last exactly (rollout.py), so a segment is token-exact as
a whole episode is under full. Each segment is a row of the update (rl/batch.rows_of) with its episode's advantage.

How segments weigh, decided: an episode counts once whatever the number of its segments, and a token is trained
once. A segment's loss mask is 1 only on the tokens sampled in it: the turns it keeps from earlier segments are
in its prompt as rendered text, mask 0, never trained again. The rows of an episode share its weight (rl/batch.py's
`weights`): under seq-mean-token-mean each of its tokens weighs 1 / the episode's action tokens, so its rows sum to
the one mean that a single row would give; under token-mean every token weighs the same, as in one row; under
seq-mean-token-sum the episode's token sum counts once (rl/losses.aggregate; tests/test_context.py checks all three
against the same tokens in one row). Unlike slime's compaction segments, which each count as a sample, a long episode
here weighs what a short one does.
"""

from __future__ import annotations

from dataclasses import dataclass

MODES = ("full", "window")


@dataclass(frozen=True)
class Context:
    mode: str = "full"
    turns: int = 0  # window: K, the turns kept

    @staticmethod
    def parse(spec: str) -> Context:
        """--context's value (full, window:K), or one sentence that says what it takes."""
        mode, _, count = spec.partition(":")
        if mode == "full" and not count:
            return Context()
        if mode in MODES and count.isdigit() and int(count) >= 1:
            return Context(mode, int(count))
        raise SystemExit(f"--context takes full or window:K (the last K turns kept, K >= 1), not {spec!r}")

    @property
    def segmented(self) -> bool:
        """Whether an episode may become several sequences (rollout.py keeps them: Trajectory.sequences)."""
        return self.mode != "full"

    def slides(self, turns: int) -> bool:
        """Whether the next turn's prompt drops something the last one had: after `turns` turns."""
        return self.mode == "window" and turns > self.turns

    def first_kept(self, messages: int, opening: int) -> int:
        """Of an episode's `messages` so far, the first after the first `opening` ones (the agent's opening, always
        kept) that the next turn's prompt holds (Trajectory.prompt_messages): under a window the last K turns', an
        assistant message and the answer to it each."""
        return max(opening, messages - 2 * self.turns) if self.mode == "window" else opening

    def __str__(self) -> str:
        return self.mode if self.mode == "full" else f"{self.mode}:{self.turns}"
