"""What a turn's prompt holds of the episode so far: one policy (--context, --reasoning drop) that answers after each
turn, and keeps its state in one field of the trajectory (Kept, Trajectory.context).

    context = Context.parse("window:4", reasoning="keep")  # --context full | window:K | summary:M; --reasoning drop
    env_turn = context.sampled(traj)                       # after a sampled turn: False for a summary, no env reads it
    segment = context.after(traj)                          # after the answer to it: continue, or a new segment
    traj.prompt_messages()                                 # what the next prompt holds (Kept.prompt)

After each turn the policy answers one of three: continue (the env's answer extends the live sequence, token in token
out: rollout.py), a new segment (the next prompt is the chat template's rendering of what is kept, ChatFormat.prompt),
or a summary turn (the answer comes with SUMMARY_REQUEST, and the next sampled turn is the summary, which no env reads
and after which a new segment starts). rollout.py asks it twice a turn (`sampled`, `after`) and does what it says; a
new mode is an edit of this file: its name in MODES and parse, its answers in `sampled` and `after`, its state in Kept.

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

drop (--reasoning drop, with any of the three): every turn starts a new segment, so each turn's prompt is the
template's rendering of what is kept, which drops earlier reasoning where the template does (Qwen3's, R1's): what an
inference server shows (rl/chat.py). Without it (keep) a new segment starts only where the kept history changes.

Segments. Where the history changes (a window slides: every turn after the K-th; a summary was written; every turn
under drop), the next turn starts a new sequence, a segment, whose prompt is the chat template's own rendering of the
kept messages; within a segment each turn extends the last exactly (rollout.py), so a segment is token-exact as a
whole episode is under full. Each segment is a row of the update (rl/batch.rows_of) with its episode's advantage.

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
REASONING = ("keep", "drop")  # --reasoning: drop, every turn a new segment (the template's rendering)
# what the env's answer comes with after every M-th turn under summary:M (on a line of its own after it)
SUMMARY_REQUEST = ("Before your next action, summarize what you have learned so far: what you did, what you found and "
                   "what remains to do. This summary will replace the turns so far, so keep everything you need. "
                   "Write only the summary.")


@dataclass(frozen=True)
class Context:
    mode: str = "full"
    turns: int = 0  # window: K, the turns kept; summary: M, the turns between summaries
    drop: bool = False  # --reasoning drop: every turn a new segment

    @staticmethod
    def parse(spec: str, reasoning: str = "keep") -> Context:
        """--context's value (full, window:K, summary:M) under --reasoning `reasoning`, or one sentence that says what
        it takes."""
        if reasoning not in REASONING:
            raise ValueError(f"--reasoning takes {' or '.join(REASONING)}, not {reasoning!r}")
        mode, _, count = spec.partition(":")
        if mode == "full" and not count:
            return Context(drop=reasoning == "drop")
        if mode in MODES[1:] and count.isdigit() and int(count) >= 1:
            return Context(mode, int(count), reasoning == "drop")
        raise SystemExit(f"--context takes full, window:K (the last K turns kept) or summary:M (a summary every M "
                         f"turns), K and M at least 1, not {spec!r}")

    @property
    def segmented(self) -> bool:
        """Whether an episode may become several sequences (Trajectory.sequences)."""
        return self.drop or self.mode != "full"

    def sampled(self, traj) -> bool:
        """After a sampled turn (its tokens and message appended): the live segment kept where an episode may have
        several; whether an env reads the turn, False for a summary (recorded in traj.summary_spans)."""
        if self.segmented and traj.token_ids:  # (a text engine's episode has no tokens)
            traj.keep_segment()
        if traj.context.summarizing:
            traj.summary_spans.append(len(traj.prompt_tokens) - 1)
            return False
        return True

    def after(self, traj) -> bool:
        """After the answer to a turn that another follows (the env's, traj.messages' last; none after a summary): what
        the next prompt keeps (traj.context), and whether it is a new segment (True: the template's rendering of
        traj.prompt_messages()) or the live one continued by the answer. Where the next turn is a summary, the answer
        comes with the request."""
        kept, turns = traj.context, traj.turns
        if kept.answer is not None:  # a summary was written: it replaces the turns before it
            # (the env's last answer without the request, as a user message, also where it was a tool's result, whose
            # call is gone)
            answer = {"role": "user", "content": kept.answer["content"]}
            kept.head = traj.messages[:kept.opening] + [traj.messages[-1], answer]
            kept.since, kept.answer = len(traj.messages), None
            return True
        if self.mode == "summary" and turns % self.turns == 0:  # the next turn writes a summary
            kept.answer = traj.messages[-1]
            traj.messages[-1] = {**kept.answer, "content": with_request(kept.answer["content"])}
        slides = self.mode == "window" and turns > self.turns
        if slides:  # the opening and, of the messages after it, the last K turns'
            kept.head, kept.since = traj.messages[:kept.opening], len(traj.messages) - 2 * self.turns
        return slides or self.drop

    def __str__(self) -> str:
        return self.mode if self.mode == "full" else f"{self.mode}:{self.turns}"


@dataclass
class Kept:
    """A trajectory's context state (Trajectory.context), written by Context alone: what the next prompt holds."""

    opening: int = 0  # the agent's opening messages (instruction, ack, first observation), which every prompt keeps
    head: list[dict] | None = None  # the prompt holds these and the messages from `since` on (None: every message)
    since: int = 0
    answer: dict | None = None  # summary:M, while a summary turn is due: the env's answer, without the request

    @property
    def summarizing(self) -> bool:
        """Whether the next sampled turn is a summary."""
        return self.answer is not None

    def prompt(self, messages: list[dict]) -> list[dict]:
        """The messages the next prompt holds, of the episode's `messages`."""
        return messages if self.head is None else self.head + messages[self.since:]


def with_request(text: str) -> str:
    """An env's answer that a summary turn follows (summary:M)."""
    return f"{text}\n\n{SUMMARY_REQUEST}"
