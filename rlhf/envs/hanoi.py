"""The built-in game: reasoning-gym's Tower of Hanoi played move by move. The policy answers with moves
('Move disk X from Peg Y to Peg Z', the task's own format, one or more per turn); the game applies them
in order and answers with the pegs as they now stand, as the next user turn, until the puzzle is solved
(reward 1), a move breaks the rules (the episode ends there, reward 0), or a turn holds no move.

A policy that writes the whole solution in its first turn plays a one-turn episode, as in the single-turn
task; one that writes part of it sees the state it reached and goes on from there. The puzzle's size
comes from the problem's reasoning-gym metadata (num_disks, num_pegs, start_peg, target_peg), or, for a
prompts file's row, from reasoning-gym's wording of the question ('... with 3 disks and 3 pegs. Move all
disks from Peg 1 to Peg 3 ...').

The task's verifier scores a move list only, and the transcript of a game holds the game's answers too,
so a game's reward is its own: pair it with `rewards: [{kind: verifier, weight: 0.0}]`.
"""

from __future__ import annotations

import re

# Numbers of at most 4 digits (puzzles have at most 12 disks and 9 pegs): a longer run of digits is no move
# and no puzzle, not an int() of unbounded length from a policy's turn or a prompts file.
MOVE = re.compile(r"move\s+disk\s+(\d{1,4})\s+from\s+peg\s+(\d{1,4})\s+to\s+peg\s+(\d{1,4})\b", re.IGNORECASE)
SIZE = re.compile(r"\b(\d{1,4})\s+disks?\s+and\s+(\d{1,4})\s+pegs", re.IGNORECASE)
ENDS = re.compile(r"from\s+peg\s+(\d{1,4})\s+to\s+peg\s+(\d{1,4})\b", re.IGNORECASE)
MAX_DISKS, MAX_PEGS = 12, 9


def puzzle(problem: dict) -> tuple[int, int, int, int]:
    """(disks, pegs, start peg, target peg) of a problem; ValueError naming the prompt when it has none."""
    meta = problem.get("metadata") or {}
    keys = ("num_disks", "num_pegs", "start_peg", "target_peg")
    if all(isinstance(meta.get(k), int) for k in keys):
        disks, pegs, start, target = (meta[k] for k in keys)
    else:
        size, ends = SIZE.search(problem.get("question") or ""), ENDS.search(problem.get("question") or "")
        if not (size and ends):
            raise ValueError(f"prompt {problem.get('id')}: the hanoi environment needs a Tower of Hanoi problem "
                             "(reasoning-gym's tower_of_hanoi metadata, or its question's wording)")
        disks, pegs, start, target = (int(x) for x in (*size.groups(), *ends.groups()))
    if not (1 <= disks <= MAX_DISKS and 3 <= pegs <= MAX_PEGS and 1 <= start <= pegs and 1 <= target <= pegs
            and start != target):
        raise ValueError(f"prompt {problem.get('id')}: not a playable puzzle ({disks} disks, {pegs} pegs, "
                         f"from peg {start} to peg {target}; at most {MAX_DISKS} disks and {MAX_PEGS} pegs)")
    return disks, pegs, start, target


class Hanoi:
    """One game: the pegs' disks bottom to top; each turn's moves are applied in order."""

    chat = True
    stop = ()

    def reset(self, problem: dict) -> None:
        disks, pegs, start, self.target = puzzle(problem)
        self.pegs = {p: [] for p in range(1, pegs + 1)}
        self.pegs[start] = list(range(disks, 0, -1))
        self.disks, self.moves = disks, 0

    def illegal(self, disk: int, src: int, dst: int) -> str | None:
        """Why a move breaks the rules, or None."""
        if src not in self.pegs or dst not in self.pegs or src == dst:
            return f"there is no move from peg {src} to peg {dst}"
        if not self.pegs[src] or self.pegs[src][-1] != disk:
            return f"disk {disk} is not on top of peg {src}"
        if self.pegs[dst] and self.pegs[dst][-1] < disk:
            return f"disk {disk} cannot go onto the smaller disk {self.pegs[dst][-1]} on peg {dst}"
        return None

    def state(self) -> str:
        return "\n".join(f"Peg {p}: {' '.join(map(str, d)) if d else 'empty'}" for p, d in self.pegs.items())

    def step(self, turn: str) -> tuple[str | None, float, bool]:
        moves = [tuple(int(x) for x in m) for m in MOVE.findall(turn)]
        if not moves:
            return None, 0.0, True
        for disk, src, dst in moves:
            if (why := self.illegal(disk, src, dst)) is not None:
                return f"Illegal move: {why}. The game is over.", 0.0, True
            self.pegs[dst].append(self.pegs[src].pop())
            self.moves += 1
            if len(self.pegs[self.target]) == self.disks:
                return None, 1.0, True
        return (f"After {self.moves} moves the pegs are (bottom to top):\n{self.state()}\n"
                f"Continue with your next moves."), 0.0, False
