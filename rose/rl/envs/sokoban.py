"""Sokoban in small rooms: push every box onto a target.

Four actions (Up, Down, Left, Right, ids 0-3): the player moves one cell, pushing a box ahead of
it if the cell beyond the box is free; a move into a wall or an unpushable box leaves everything
in place (a legal action all the same). Rewards follow gym-sokoban's: `-step_penalty` every
turn, `+box_reward` for each box pushed onto a target (minus as much for pushing one off), and
`+solve_reward` when all boxes are on targets, which ends the episode.

Levels are either fixed (`level=` an index into `FIXED_LEVELS` or rows of text) or generated
from each reset's seed by reverse play: boxes start on their targets and the player walks
randomly, *pulling* any box it backs away from; replaying those pulls as pushes solves the
level, so every generated level is solvable by construction.

Rendering, one character per cell:  # wall, _ floor, O target, X box, * box on a target,
P player, + player on a target.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Sequence

from rose.rl.envs.base import ActionEnv, check_non_negative, check_positive_int
from rose.rl.envs.heldout import check_split, draw

Cell = tuple[int, int]
_MOVES = ((-1, 0), (1, 0), (0, -1), (0, 1))  # Up, Down, Left, Right as (drow, dcol)

FIXED_LEVELS: tuple[tuple[str, ...], ...] = (
    ("#####",
     "#P__#",
     "#_X_#",
     "#__O#",
     "#####"),
    ("######",
     "#__O_#",
     "#_X__#",
     "#_#P_#",
     "#____#",
     "######"),
    ("#######",
     "#__O__#",
     "#_X_#_#",
     "#__P__#",
     "#_#X__#",
     "#__O__#",
     "#######"),
)


def _add(a: Cell, b: Cell) -> Cell:
    return a[0] + b[0], a[1] + b[1]


@dataclasses.dataclass
class Level:
    """Walls and targets (fixed) plus boxes and the player (moving)."""

    shape: tuple[int, int]
    walls: frozenset[Cell]
    targets: frozenset[Cell]
    boxes: set[Cell]
    player: Cell

    @classmethod
    def parse(cls, rows: Sequence[str]) -> Level:
        rows = tuple(rows)
        if not rows or any(not isinstance(r, str) or len(r) != len(rows[0]) for r in rows):
            raise ValueError("sokoban: a level must be a non-empty list of equal-length strings")
        cells = {(r, c): ch for r, row in enumerate(rows) for c, ch in enumerate(row)}
        bad = set(cells.values()) - set("#_OX*P+")
        players = [p for p, ch in cells.items() if ch in "P+"]
        boxes = {p for p, ch in cells.items() if ch in "X*"}
        targets = frozenset(p for p, ch in cells.items() if ch in "O*+")
        if bad or len(players) != 1 or not boxes or len(boxes) != len(targets):
            raise ValueError("sokoban: a level holds only # _ O X * P +, one player and as many boxes as "
                             f"targets (at least one); got {list(rows)}")
        walls = frozenset(p for p, ch in cells.items() if ch == "#")
        return cls((len(rows), len(rows[0])), walls, targets, boxes, players[0])

    def free(self, cell: Cell) -> bool:
        inside = 0 <= cell[0] < self.shape[0] and 0 <= cell[1] < self.shape[1]
        return inside and cell not in self.walls and cell not in self.boxes

    def render(self) -> str:
        def char(cell: Cell) -> str:
            if cell in self.walls:
                return "#"
            on_target = cell in self.targets
            if cell == self.player:
                return "+" if on_target else "P"
            if cell in self.boxes:
                return "*" if on_target else "X"
            return "O" if on_target else "_"
        return "\n".join("".join(char((r, c)) for c in range(self.shape[1])) for r in range(self.shape[0]))


def _carve_room(size: int, rng: random.Random) -> set[Cell]:
    """Floor cells of a `size` x `size` room (walls all round), carved by a random walk until
    about 60% of the interior is floor."""
    inner = size - 2
    cell = (rng.randrange(inner) + 1, rng.randrange(inner) + 1)
    floor, move = {cell}, rng.choice(_MOVES)
    while len(floor) < 0.6 * inner * inner:
        if rng.random() < 0.35:
            move = rng.choice(_MOVES)
        nxt = _add(cell, move)
        if 1 <= nxt[0] <= inner and 1 <= nxt[1] <= inner:
            cell = nxt
            floor.add(cell)
    return floor


def _box_distance(boxes: set[Cell], targets: frozenset[Cell]) -> int:
    return sum(min(abs(b[0] - t[0]) + abs(b[1] - t[1]) for t in targets) for b in boxes)


def generate_level(size: int, num_boxes: int, seed: int, steps: int = 40) -> tuple[str, ...]:
    """A solvable `size` x `size` level: `steps` random reverse moves from the solved state,
    keeping the state whose boxes are farthest from the targets."""
    rng = random.Random(seed)
    while True:
        floor = _carve_room(size, rng)
        if len(floor) < 2 * num_boxes + 2:
            continue
        targets = frozenset(rng.sample(sorted(floor), num_boxes))
        boxes = set(targets)
        player = rng.choice(sorted(floor - boxes))
        best, best_distance = None, 0
        for _ in range(steps):
            move = rng.choice(_MOVES)
            nxt = _add(player, move)
            if nxt not in floor or nxt in boxes:
                continue
            behind = (2 * player[0] - nxt[0], 2 * player[1] - nxt[1])
            if behind in boxes:  # pull it along: the forward push goes the other way
                boxes.remove(behind)
                boxes.add(player)
            player = nxt
            distance = _box_distance(boxes, targets)
            if distance > best_distance:
                best, best_distance = (set(boxes), player), distance
        if best is None:
            continue
        boxes, player = best
        walls = frozenset((r, c) for r in range(size) for c in range(size)) - floor
        return tuple(Level((size, size), walls, targets, boxes, player).render().split("\n"))


class Sokoban(ActionEnv):
    name = "sokoban"
    actions = ("Up", "Down", "Left", "Right")

    def __init__(self, size: int = 6, num_boxes: int = 1, level: int | Sequence[str] | None = None,
                 max_turns: int = 20, invalid_penalty: float = 0.1, step_penalty: float = 0.1,
                 box_reward: float = 1.0, solve_reward: float = 10.0, split: str | None = None,
                 ask: bool = False) -> None:
        """`level`: an index into `FIXED_LEVELS` or rows of text; None generates a `size` x
        `size` level with `num_boxes` boxes from each reset's seed (only from the `split`
        "train" or "eval" of rose.rl.envs.heldout when given)."""
        if isinstance(level, int) and not isinstance(level, bool):
            if not 0 <= level < len(FIXED_LEVELS):
                raise ValueError(f"sokoban: level {level} does not exist; expected 0.."
                                 f"{len(FIXED_LEVELS) - 1}, rows of text, or None to generate levels")
            level = FIXED_LEVELS[level]
        elif level is not None and (isinstance(level, str) or not isinstance(level, Sequence)):
            raise ValueError(f"sokoban: level must be an index, rows of text or None, got {level!r}")
        self._fixed = tuple(Level.parse(level).render().split("\n")) if level is not None else None
        if self._fixed is None:
            if isinstance(size, bool) or not isinstance(size, int) or not 5 <= size <= 10:
                raise ValueError(f"sokoban: size must be an integer in [5, 10], got {size!r}")
            check_positive_int(self.name, "num_boxes", num_boxes)
            if num_boxes > (size - 2) ** 2 // 4:
                raise ValueError(f"sokoban: {num_boxes} boxes do not fit a {size}x{size} room; "
                                 f"expected at most {(size - 2) ** 2 // 4}")
        self.size, self.num_boxes = size, num_boxes
        self.step_penalty = check_non_negative(self.name, "step_penalty", step_penalty)
        self.box_reward = check_non_negative(self.name, "box_reward", box_reward)
        self.solve_reward = check_non_negative(self.name, "solve_reward", solve_reward)
        self.split = check_split(self.name, split, self._fixed is None)
        super().__init__(max_turns, invalid_penalty, ask)
        self._rng = random.Random()
        self.level = Level.parse(self._fixed or FIXED_LEVELS[0])

    @property
    def system_prompt(self) -> str:
        return ("You are playing Sokoban. Push every box onto a target. Walls are #, floor is _, boxes "
                "are X, targets are O, a box on a target is *, the player is P (+ on a target). You "
                "push a box by walking into it. Actions: Up, Down, Left, Right. Answer with one "
                "action, for example Left.")

    @property
    def success(self) -> bool:
        return self.level.boxes <= self.level.targets

    def _reset(self, seed: int | None) -> None:
        self._rng = random.Random(seed) if seed is not None else self._rng
        rows = self._fixed or draw(self.name, lambda seed: generate_level(self.size, self.num_boxes, seed),
                                   self._rng, self.split)
        self.level = Level.parse(rows)

    def _act(self, action: int) -> tuple[float, bool, bool]:
        lv, move = self.level, _MOVES[action]
        reward = -self.step_penalty
        nxt = _add(lv.player, move)
        if nxt in lv.boxes:
            beyond = _add(nxt, move)
            if lv.free(beyond):
                lv.boxes.remove(nxt)
                lv.boxes.add(beyond)
                reward += self.box_reward * ((beyond in lv.targets) - (nxt in lv.targets))
                lv.player = nxt
        elif lv.free(nxt):
            lv.player = nxt
        if self.success:
            reward += self.solve_reward
        return reward, self.success, False

    def render(self) -> str:
        status = "All boxes are on targets." if self.success else ""
        return self.level.render() + ("\n" + status if status else "")
