"""A tiny text maze in plain Python: no package, Gymnasium's signatures. It plays as `--env gym:docs.examples.maze:Maze`
(docs/bring-your-own-env.md), and the page's other examples wrap this same game."""

import random

MOVES = {"north": (-1, 0), "south": (1, 0), "west": (0, -1), "east": (0, 1)}
BACK = {"north": "south", "south": "north", "west": "east", "east": "west"}


def carve(size: int, seed: int | None) -> dict:
    """A maze of size x size rooms, drawn from the seed (a random depth-first search): each room's exits."""
    rng, exits = random.Random(seed), {(r, c): set() for r in range(size) for c in range(size)}
    path = [(0, 0)]
    while path:
        r, c = path[-1]
        new = [(move, (r + dr, c + dc)) for move, (dr, dc) in MOVES.items()
               if (r + dr, c + dc) in exits and not exits[(r + dr, c + dc)] and (r + dr, c + dc) != (0, 0)]
        if not new:
            path.pop()
            continue
        move, room = rng.choice(new)
        exits[(r, c)].add(move)
        exits[room].add(BACK[move])
        path.append(room)
    return exits


class Maze:
    metadata = {"description": "You are in a maze of rooms. Each turn, go north, south, east or west. Find the exit."}

    def __init__(self, size: int = 3, max_turns: int = 12):
        self.size, self.max_turns = size, max_turns

    def reset(self, seed: int | None = None, options: dict | None = None) -> tuple[str, dict]:
        self.exits, self.room, self.turns = carve(self.size, seed), (0, 0), 0
        self.exit = (self.size - 1, self.size - 1)
        return f"The exit is in room {self.exit}. {self.where()}", {}

    def where(self) -> str:
        return f"You are in room {self.room}; doors: {', '.join(sorted(self.exits[self.room]))}."

    def step(self, action: str) -> tuple[str, float, bool, bool, dict]:
        self.turns += 1
        truncated = self.turns >= self.max_turns
        move = action.strip().lower()
        if move not in self.exits[self.room]:
            return f"You cannot go {move!r} here. {self.where()}", 0.0, False, truncated, {"valid": False}
        self.room = (self.room[0] + MOVES[move][0], self.room[1] + MOVES[move][1])
        if self.room == self.exit:
            return "You found the exit!", 1.0, True, False, {}
        return self.where(), 0.0, False, truncated, {}
