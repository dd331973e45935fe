"""FrozenLake in text, with gymnasium's `FrozenLake-v1` maps and dynamics.

The agent walks a grid from S to the goal G; stepping on a hole H ends the episode; the reward
is 1 on reaching G and 0 otherwise. Moves off the grid leave the agent in place. On slippery
ice the agent moves in the intended direction or in either perpendicular one, 1/3 each
(gymnasium: `[(a - 1) % 4, a, (a + 1) % 4]`). Action ids are gymnasium's: 0 Left, 1 Down,
2 Right, 3 Up.

Observation (kept short so that a ~0.1M-parameter policy can learn it): the grid with P where
the agent stands (`show_grid=False` leaves it out), then the position spelled out, last, next to
where the reply starts:

    PFFF
    FHFH
    FFFH
    HFFG
    You are at row 0, column 0.

`progress_reward` adds potential-based shaping (Ng, Harada and Russell 1999) for policies that
rarely reach G by chance: each move earns `progress_reward` times the fraction of the shortest
safe path to G it covers (negative when it moves away), and falling into a hole takes back
whatever the episode had earned. An episode's shaping thus sums to `progress_reward` times the
fraction of the way covered where it ends (0 in a hole), and the goal's 1 stays the larger
prize while `progress_reward` < 1. Off (0) by default, which is gymnasium's reward.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Sequence

from rose.rl.envs.base import ActionEnv, check_non_negative
from rose.rl.envs.heldout import check_split, draw

# gymnasium's `MAPS["4x4"]` and `MAPS["8x8"]`.
STANDARD_MAPS: dict[int, tuple[str, ...]] = {
    4: ("SFFF", "FHFH", "FFFH", "HFFG"),
    8: ("SFFFFFFF", "FFFFFFFF", "FFFHFFFF", "FFFFFHFF",
        "FFFHFFFF", "FHHFFFHF", "FHFFHFHF", "FFFHFFFG"),
}
# Enough turns for a detour or two around the holes (4 x side for other sizes); gymnasium's
# own limits (100, 200) are far longer than a multi-turn LLM episode can afford.
DEFAULT_MAX_TURNS = {4: 10, 8: 30}
_MOVES = ((0, -1), (1, 0), (0, 1), (-1, 0))  # Left, Down, Right, Up as (drow, dcol)


def _distances(desc: Sequence[str], sources: Sequence[tuple[int, int]]) -> dict[tuple[int, int], int]:
    """Moves from the nearest of `sources` to every cell reachable without entering a hole
    (moves are reversible, so this is also the distance to the sources)."""
    rows, cols = len(desc), len(desc[0])
    dist, todo = dict.fromkeys(sources, 0), deque(sources)
    while todo:
        r, c = todo.popleft()
        for dr, dc in _MOVES:
            nxt = (r + dr, c + dc)
            if 0 <= nxt[0] < rows and 0 <= nxt[1] < cols and nxt not in dist and desc[nxt[0]][nxt[1]] != "H":
                dist[nxt] = dist[(r, c)] + 1
                todo.append(nxt)
    return dist


def generate_map(size: int, p_frozen: float, seed: int) -> tuple[str, ...]:
    """A `size` x `size` map, S top left and G bottom right, each other tile frozen with
    probability `p_frozen`, redrawn until G is reachable (as gymnasium's generator does)."""
    rng = random.Random(seed)
    while True:
        cells = [["F" if rng.random() < p_frozen else "H" for _ in range(size)] for _ in range(size)]
        cells[0][0], cells[-1][-1] = "S", "G"
        desc = tuple("".join(row) for row in cells)
        if (size - 1, size - 1) in _distances(desc, [(0, 0)]):
            return desc


def _check_desc(desc: Sequence[str]) -> tuple[str, ...]:
    rows = tuple(desc)
    if not rows or any(not isinstance(r, str) or len(r) != len(rows[0]) for r in rows):
        raise ValueError("frozenlake: desc must be a non-empty list of equal-length strings")
    text = "".join(rows)
    if set(text) - set("SFHG") or text.count("S") != 1 or "G" not in text:
        raise ValueError("frozenlake: desc may hold only S, F, H, G, with exactly one S and at least one G; "
                         f"got {list(rows)}")
    return rows


class FrozenLake(ActionEnv):
    name = "frozenlake"
    actions = ("Left", "Down", "Right", "Up")

    def __init__(self, size: int = 4, random_map: bool = False, desc: Sequence[str] | None = None,
                 slippery: bool = False, p_frozen: float = 0.8, max_turns: int | None = None,
                 invalid_penalty: float = 0.1, show_grid: bool = True, progress_reward: float = 0.0,
                 split: str | None = None, ask: bool = False) -> None:
        """`desc` (rows of S/F/H/G) overrides the map; else `random_map` draws a solvable
        `size` x `size` map from each reset's seed (only from the `split` "train" or "eval" of
        rose.rl.envs.heldout when given), else the standard 4x4 or 8x8 map."""
        if desc is None and not random_map and size not in STANDARD_MAPS:
            raise ValueError(f"frozenlake: size {size!r} has no standard map; expected 4 or 8, "
                             "or random_map=True, or a desc")
        if random_map and (isinstance(size, bool) or not isinstance(size, int) or not 2 <= size <= 16):
            raise ValueError(f"frozenlake: size must be an integer in [2, 16] for random maps, got {size!r}")
        if not 0 < check_non_negative(self.name, "p_frozen", p_frozen) <= 1:
            raise ValueError(f"frozenlake: p_frozen must be in (0, 1], got {p_frozen!r}")
        self._fixed = _check_desc(desc) if desc is not None else None if random_map else STANDARD_MAPS[size]
        for name, flag in (("random_map", random_map), ("slippery", slippery), ("show_grid", show_grid)):
            if not isinstance(flag, bool):
                raise ValueError(f"frozenlake: {name} must be true or false, got {flag!r}")
        self.size, self.slippery, self.p_frozen, self.show_grid = size, slippery, float(p_frozen), show_grid
        self.progress_reward = check_non_negative(self.name, "progress_reward", progress_reward)
        self.split = check_split(self.name, split, self._fixed is None)
        side = len(self._fixed) if self._fixed else size
        super().__init__(DEFAULT_MAX_TURNS.get(side, 4 * side) if max_turns is None else max_turns,
                         invalid_penalty, ask)
        self._rng = random.Random()
        self.desc: tuple[str, ...] = self._fixed or ()
        self.pos = self._start = (0, 0)
        self._distance: dict[tuple[int, int], int] = {}  # safe steps to the nearest G

    @property
    def system_prompt(self) -> str:
        slip = (" The ice is slippery: a move may go sideways instead." if self.slippery else "")
        return ("You are playing FrozenLake. The agent starts at S and must reach the goal G without "
                "falling into a hole H. Frozen tiles are F. P is you." + slip +
                " Actions: Left, Down, Right, Up. Answer with one action, for example Right.")

    @property
    def tile(self) -> str:
        return self.desc[self.pos[0]][self.pos[1]]

    @property
    def success(self) -> bool:
        return self.tile == "G"

    def _reset(self, seed: int | None) -> None:
        self._rng = random.Random(seed) if seed is not None else self._rng
        if self._fixed is None:
            self.desc = draw(self.name, lambda seed: generate_map(self.size, self.p_frozen, seed),
                             self._rng, self.split)
        text = "".join(self.desc)
        self.pos = self._start = divmod(text.index("S"), len(self.desc[0]))
        goals = [divmod(i, len(self.desc[0])) for i, ch in enumerate(text) if ch == "G"]
        self._distance = _distances(self.desc, goals)

    def _potential(self) -> float:
        """Minus `progress_reward` times the share of the start's distance to G still ahead;
        holes (and cells cut off from G) count as far as the start."""
        start = max(self._distance.get(self._start, 0), 1)
        return -self.progress_reward * min(self._distance.get(self.pos, start), start) / start

    def _act(self, action: int) -> tuple[float, bool, bool]:
        if self.slippery:
            action = (action + self._rng.choice((-1, 0, 1))) % 4
        before = self._potential()
        dr, dc = _MOVES[action]
        r, c = self.pos[0] + dr, self.pos[1] + dc
        if 0 <= r < len(self.desc) and 0 <= c < len(self.desc[0]):
            self.pos = (r, c)
        shaping = self._potential() - before
        return (1.0 if self.tile == "G" else 0.0) + shaping, self.tile in "GH", False

    def render(self) -> str:
        rows = [list(row) for row in self.desc]
        rows[self.pos[0]][self.pos[1]] = "P"
        status = {"G": "You reached the goal.", "H": "You fell into a hole."}.get(
            self.tile, f"You are at row {self.pos[0]}, column {self.pos[1]}.")
        grid = "\n".join("".join(row) for row in rows) + "\n" if self.show_grid else ""
        return grid + status
