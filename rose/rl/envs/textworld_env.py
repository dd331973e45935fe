"""TextWorld's generated quests as environments (`make_env("textworld", ...)`).

TextWorld (Microsoft, MIT; Côté et al. 2018) generates text adventures with a quest: rooms,
objects, containers and doors, and a goal reached by a chain of actions ("take the key from the
table, unlock the chest, put the apple in the chest"). Its generated games are the substrate of
ALFWorld, the paper's second workload. Games are made here, on first use, by TextWorld's own
`tw-make custom` (nothing is downloaded), one per game seed, and kept in `games_dir`
(`ROSE_TEXTWORLD_GAMES`, default `~/.cache/rose/textworld`): a pool of `games` games of the
given size; each reset plays one of them, from the start. The game's own interpreter (Jericho)
runs it in a child process of its own, as TextWorld's batch environments do: Jericho keeps
process-wide state, and a rollout plays many games at once.

The observation is the game's text, then the commands the game accepts now (TextWorld's
`admissible_commands`, as ALFWorld's text agents get them). A reply is matched to the longest
accepted command it contains (else its first line is sent as typed: the game answers what it
makes of it). The reward is the quest's score gained, over the game's maximum, so an episode's
return is 1 when it wins; success is winning.

Held-out games: with `split`, a game seed belongs to the evaluation split when it is 0 modulo
`rose.rl.envs.heldout.HELDOUT_EVERY` (each seed is a different game).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any

from rose.rl.envs.base import StepResult, TextEnv, check_positive_int
from rose.rl.envs.heldout import HELDOUT_EVERY, check_split

GAME_TIMEOUT_S = 300.0  # tw-make compiles the game with Inform 7: seconds, more on a loaded machine
STEP_TIMEOUT_S = 60.0  # a game's answer to one command (milliseconds, unless something is wrong)
_STATE = ("feedback", "admissible_commands", "score", "max_score", "won", "lost")
_TYPED = re.compile(r"[^A-Za-z0-9 ,.'!?-]+")
MAX_COMMAND_CHARS = 100


def games_dir() -> Path:
    return Path(os.environ.get("ROSE_TEXTWORLD_GAMES", Path.home() / ".cache" / "rose" / "textworld"))


def _tw_make() -> str:
    found = shutil.which("tw-make") or shutil.which("tw-make", path=str(Path(sys.executable).parent))
    if found is None:
        raise ValueError("textworld: tw-make is not installed here (`make install` installs TextWorld)")
    return found


def make_game(world_size: int, nb_objects: int, quest_length: int, seed: int, directory: Path) -> Path:
    """The game of these settings and seed, made by `tw-make custom` unless it already exists."""
    path = directory / f"w{world_size}-o{nb_objects}-q{quest_length}-s{seed}.z8"
    if path.is_file():
        return path
    directory.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.stem}-{os.getpid()}.z8")  # renamed into place: racing runs agree
    command = [_tw_make(), "custom", "--world-size", str(world_size), "--nb-objects", str(nb_objects),
               "--quest-length", str(quest_length), "--seed", str(seed), "--output", str(partial), "--silent",
               "-f"]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=GAME_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired:
        raise ValueError(f"textworld: tw-make took over {GAME_TIMEOUT_S:g} s for {path.name}") from None
    if done.returncode != 0 or not partial.is_file():
        error = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
        raise ValueError(f"textworld: tw-make could not make {path.name}: {error[0]}")
    for suffix in (".json", ".ni"):  # its metadata, beside the game
        if partial.with_suffix(suffix).is_file():
            os.replace(partial.with_suffix(suffix), path.with_suffix(suffix))
    os.replace(partial, path)
    return path


def match_command(text: str, commands: list[str]) -> str:
    """The longest accepted command the reply contains, else its first line as typed, in
    letters, digits and plain punctuation only (the interpreter reads a backslash as an escape
    of its own and then waits for more)."""
    lowered = text.lower()
    found = [c for c in commands if c.lower() in lowered]
    if found:
        return max(found, key=len)
    lines = text.strip().splitlines()
    return _TYPED.sub(" ", lines[0])[:MAX_COMMAND_CHARS].strip() if lines else ""


def _play(path: str, pipe: Any) -> None:
    """A child process's loop: start the game, answer each command with the new state (and
    whether the game is over), until None. It runs in a scratch directory of its own: the
    interpreter writes the file a `save` or `script` command names where it runs."""
    import textworld

    with tempfile.TemporaryDirectory(prefix="rose-textworld-") as scratch:
        os.chdir(scratch)
        with warnings.catch_warnings():
            # Jericho knows TextWorld's games by no table of its own; TextWorld keeps the score.
            warnings.filterwarnings("ignore", message=".*is not fully supported")
            infos = textworld.EnvInfos(admissible_commands=True, won=True, lost=True, max_score=True,
                                       score=True)
            env = textworld.start(path, request_infos=infos)
            state, over = env.reset(), False
        try:
            while True:
                pipe.send(({key: state[key] for key in _STATE}, over))
                command = pipe.recv()
                if command is None:
                    return
                state, _, over = env.step(command)
        finally:
            env.close()


class _Game:
    """One game played in a child process, forked by a server that has imported this module,
    TextWorld and Jericho once (a game starts in a fraction of a second, not the seconds of
    their imports)."""

    context = multiprocessing.get_context("forkserver")

    def __init__(self, path: Path) -> None:
        # This module too: a child unpickles `_play` from it, which imports rose.rl (and torch).
        self.context.set_forkserver_preload([__name__, "textworld.envs.zmachine.jericho"])
        self.pipe, child = self.context.Pipe()
        self.process = self.context.Process(target=_play, args=(str(path.resolve()), child), daemon=True)
        self.process.start()
        child.close()

    def answer(self) -> tuple[dict[str, Any], bool]:
        if not self.pipe.poll(STEP_TIMEOUT_S):
            self.close()
            raise RuntimeError(f"textworld: the game did not answer within {STEP_TIMEOUT_S:g} s")
        return self.pipe.recv()

    def step(self, command: str) -> tuple[dict[str, Any], bool]:
        self.pipe.send(command)
        return self.answer()

    def close(self) -> None:
        if self.process.is_alive():
            with contextlib.suppress(OSError):  # it went already
                self.pipe.send(None)
            self.process.join(5.0)
            if self.process.is_alive():
                self.process.kill()
                self.process.join()
        self.pipe.close()


class TextWorldGame(TextEnv):
    name = "textworld"

    def __init__(self, world_size: int = 2, nb_objects: int = 4, quest_length: int = 2, games: int = 16,
                 max_turns: int = 12, split: str | None = None, show_commands: bool = True) -> None:
        try:
            import textworld  # noqa: F401
        except ImportError:
            raise ValueError("textworld: the textworld package is not installed (`make install` "
                             "installs it)") from None
        for key, value in (("world_size", world_size), ("nb_objects", nb_objects),
                           ("quest_length", quest_length), ("games", games)):
            check_positive_int(self.name, key, value)
        self.settings = (world_size, nb_objects, quest_length)
        self.split = check_split(self.name, split, generated=True)
        seeds = [s for s in range(games) if split is None or (s % HELDOUT_EVERY == 0) == (split == "eval")]
        if not seeds:
            raise ValueError(f"textworld: no {split} game among {games} (one in {HELDOUT_EVERY} is held out)")
        self.seeds, self.max_turns = seeds, check_positive_int(self.name, "max_turns", max_turns)
        self.show_commands = show_commands
        self._game: _Game | None = None
        self._state: dict[str, Any] = {}
        self._rng = random.Random()
        self.turn, self.done, self.won = 0, True, False

    @property
    def system_prompt(self) -> str:
        return ("You are playing a text adventure. Reach the goal the game gives you. Each turn, answer "
                "with one command the game accepts, for example: open the door.")

    def reset(self, seed: int | None = None) -> str:
        self._rng = random.Random(seed) if seed is not None else self._rng
        path = make_game(*self.settings, self._rng.choice(self.seeds), games_dir())
        self.close()
        self._game = _Game(path)
        self._state, _ = self._game.answer()
        self.turn, self.done, self.won = 0, False, False
        return self._observation()

    def step(self, text: str) -> StepResult:
        if self.done or self._game is None:
            raise RuntimeError(f"{self.name}: step() after the episode ended; call reset() first")
        self.turn += 1
        command = match_command(text, list(self._state["admissible_commands"] or []))
        before = self._state["score"]
        self._state, over = self._game.step(command)
        reward = (self._state["score"] - before) / max(self._state["max_score"], 1)
        self.won = bool(self._state["won"])
        truncated = not over and self.turn >= self.max_turns
        self.done = bool(over) or truncated
        if self.done:
            self.close()
        info = {"command": command, "success": self.won, "lost": bool(self._state["lost"]), "turn": self.turn,
                "truncated": truncated}
        return StepResult(self._observation(), float(reward), self.done, info)

    def _observation(self) -> str:
        text = str(self._state["feedback"]).strip()
        if self.show_commands and not self.done:
            text += "\nCommands: " + ", ".join(self._state["admissible_commands"] or [])
        return text

    def close(self) -> None:
        """End the game's process (each reset starts one)."""
        if self._game is not None:
            self._game.close()
            self._game = None

    def __del__(self) -> None:
        if getattr(self, "_game", None) is not None:  # not when __init__ refused the settings
            self.close()
