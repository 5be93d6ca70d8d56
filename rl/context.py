"""--context: what a turn's prompt holds of the episode so far, for long horizons (issue 46).

    context = Context.parse("window:4")                    # full | window:K | summary:M
    context.slide(traj)                                    # then traj.prompt_messages(): what the next prompt holds

full (the default): every turn's prompt is the whole episode, one sequence that each turn extends by its sampled
tokens and the observation (rollout.py's token-in-token-out). At 30 turns, or with WebArena's pages, it grows until
the token budget ends the episode.

window:K: the opening (the instruction, the agent's acknowledgement and the first observation, which states the
task) and the last K turns, each an assistant reply and the env's answer to it; older turns are dropped. The prompt
stops growing after K turns (verl-agent's memory module keeps ALFWorld's prompts flat the same way).

summary:M: after every M-th turn the env's answer comes with a request (SUMMARY_REQUEST) and the policy's next turn is
a summary of the episode so far, which no env reads; the next turn's prompt is then the opening, that summary (an
assistant message) and the env's last answer, without the request: the summary replaces every turn before it. The
summary turn is a turn like any other, sampled by the policy and trained with the episode's advantage; it does not
count against the horizon (env turns), and for GiGPO it belongs to the env turn it precedes (the state it was written
in: rl/trajectory.py's token_turns).

Segments. Where the history changes (a window slides: every turn after the K-th; a summary was written), the next turn
starts a new sequence,
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

MODES = ("full", "window", "summary")
# what the env's answer comes with after every M-th turn under summary:M (on a line of its own after it)
SUMMARY_REQUEST = ("Before your next action, summarize what you have learned so far: what you did, what you found and "
                   "what remains to do. This summary will replace the turns so far, so keep everything you need. "
                   "Write only the summary.")


@dataclass(frozen=True)
class Context:
    mode: str = "full"
    turns: int = 0  # window: K, the turns kept; summary: M, the turns between summaries

    @staticmethod
    def parse(spec: str) -> Context:
        """--context's value (full, window:K, summary:M), or one sentence that says what it takes."""
        mode, _, count = spec.partition(":")
        if mode == "full" and not count:
            return Context()
        if mode in MODES[1:] and count.isdigit() and int(count) >= 1:
            return Context(mode, int(count))
        raise SystemExit(f"--context takes full, window:K (the last K turns kept) or summary:M (a summary every M "
                         f"turns), K and M at least 1, not {spec!r}")

    @property
    def segmented(self) -> bool:
        """Whether an episode may become several sequences (rollout.py keeps them: Trajectory.sequences)."""
        return self.mode != "full"

    def slides(self, turns: int) -> bool:
        """Whether the next turn's prompt drops something the last one had: after `turns` turns."""
        return self.mode == "window" and turns > self.turns

    def summarizes(self, turns: int) -> bool:
        """Whether the policy writes a summary after `turns` env turns (before the next one)."""
        return self.mode == "summary" and turns % self.turns == 0

    def slide(self, traj) -> None:
        """Where a window slides (after traj.turns turns), the next prompt: the opening and, of the messages after it,
        the last K turns' (Trajectory.prompt_messages); elsewhere nothing changes."""
        if self.slides(traj.turns):
            traj.context, traj.since = traj.messages[:traj.opening], len(traj.messages) - 2 * self.turns

    @staticmethod
    def summarized(traj) -> None:
        """After a summary turn: the next prompt is the opening, the summary and the env's last answer without the
        request (Trajectory.answer; as a user message, also where it was a tool's result, whose call is gone), the
        turns before the summary gone."""
        answer = {"role": "user", "content": traj.answer["content"]}  # (a tool result would answer no call here)
        traj.context, traj.since = traj.messages[:traj.opening] + [traj.messages[-1], answer], len(traj.messages)
        traj.summarizing = False

    def __str__(self) -> str:
        return self.mode if self.mode == "full" else f"{self.mode}:{self.turns}"


def restart(fmt, traj, max_tokens: int) -> None:
    """A new segment: the next turn's prompt is the template's rendering of what the context keeps (its budget left
    no room for a reply: the episode ends, finish max_tokens)."""
    prompt = fmt.prompt(traj.prompt_messages(), tools=traj.tools)
    if max_tokens - len(prompt) - 1 < 1:
        traj.finish = "max_tokens"
    else:
        traj.restart(prompt)


def with_request(text: str) -> str:
    """An env's answer that a summary turn follows (summary:M)."""
    return f"{text}\n\n{SUMMARY_REQUEST}"
