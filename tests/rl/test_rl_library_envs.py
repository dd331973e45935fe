"""Environments from libraries nobody here wrote, behind the registry: reasoning-gym's verifiable
tasks and TextWorld's generated quests (made locally by `tw-make`, played by the game's own
interpreter)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rose.rl import make_env
from rose.rl.envs.reasoning import untagged_answer
from rose.rl.envs.textworld_env import make_game, match_command

pytest.importorskip("reasoning_gym")
pytest.importorskip("textworld")

ARITHMETIC = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2}


def test_a_reasoning_gym_task_scores_the_answer_in_its_tags() -> None:
    env = make_env("reasoning-gym", task="basic_arithmetic", config=ARITHMETIC)
    question = env.reset(3)
    assert question == make_env("reasoning-gym", task="basic_arithmetic", config=ARITHMETIC).reset(3)
    expected = env._entry["answer"]
    result = env.step(f"Let me add them up. <answer>{expected}</answer>")
    assert result.done and result.reward == 1.0 and result.info["success"]
    assert result.info["answer"] == expected
    env.reset(3)
    wrong = env.step("<answer>not a number</answer>")
    assert wrong.done and wrong.reward < 1.0 and not wrong.info["success"] and wrong.info["truncated"]


def test_an_untagged_reply_is_scored_whole_or_by_its_last_number() -> None:
    """reasoning-gym's convention reads a reply without tags whole; `fallback="last-number"`
    reads its last number, as a sentence a small model answers in ("6 * 8 is 48.")."""
    whole = make_env("reasoning-gym", task="products", config=ARITHMETIC)
    whole.reset(5)
    expected = whole._entry["answer"]
    assert not whole.step(f"So the product is {expected}.").info["success"]
    last = make_env("reasoning-gym", task="products", config=ARITHMETIC, fallback="last-number")
    last.reset(5)
    result = last.step(f"Multiply 3 by 4 and the product is {expected}.")
    assert result.info["success"] and result.info["answer"] == expected
    last.reset(5)
    assert last.step(f"<answer>{int(expected) + 1}</answer> is {expected}").reward < 1.0  # tags win
    last.reset(5)
    assert not last.step("I cannot say.").info["success"]
    assert untagged_answer("It is -1,234.5, or 1,2 and 7,", "last-number") == "7"
    assert untagged_answer("It is -1,234.5.", "last-number") == "-1,234.5"
    assert untagged_answer("  no number ", "last-number") == "" and untagged_answer(" 12 ", "reply") == "12"
    with pytest.raises(ValueError, match="reasoning-gym: fallback must be one of reply, last-number"):
        make_env("reasoning-gym", fallback="first-number")


def test_a_wrong_answer_may_be_tried_again_while_turns_are_left() -> None:
    env = make_env("reasoning-gym", task="basic_arithmetic", config=ARITHMETIC, max_turns=2)
    env.reset(0)
    first = env.step("<answer>nope</answer>")
    assert not first.done and "Try again" in first.observation
    second = env.step(f"<answer>{env._entry['answer']}</answer>")
    assert second.done and second.info["success"] and second.info["turn"] == 2


def test_reasoning_gym_splits_hold_out_problems_and_bad_settings_are_refused() -> None:
    train = {make_env("reasoning-gym", config=ARITHMETIC, split="train").reset(s) for s in range(40)}
    held = {make_env("reasoning-gym", config=ARITHMETIC, split="eval").reset(s) for s in range(40)}
    assert train and held and not train & held
    with pytest.raises(ValueError, match="reasoning-gym: no task 'no_such_task'"):
        make_env("reasoning-gym", task="no_such_task")
    with pytest.raises(ValueError, match="reasoning-gym: task 'basic_arithmetic' refuses config"):
        make_env("reasoning-gym", config={"min_terms": 5, "max_terms": 2})


def test_reasoning_gym_can_hold_out_by_answer() -> None:
    """By question, a held-out "6 * 8" may have its twin "8 * 6" trained on; by answer, no
    held-out problem shares its answer with a trained one."""
    one_digit = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}

    def answers(split: str, heldout: str) -> set[str]:
        env = make_env("reasoning-gym", task="products", config=one_digit, split=split, heldout=heldout)
        return {(env.reset(s), env._entry["answer"])[1] for s in range(300)}

    assert answers("train", "question") & answers("eval", "question")
    train, held = answers("train", "answer"), answers("eval", "answer")
    assert train and held and not train & held
    with pytest.raises(ValueError, match="reasoning-gym: heldout must be one of question, answer"):
        make_env("reasoning-gym", heldout="seed")


@pytest.fixture(scope="module")
def games(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("textworld")


@pytest.fixture
def games_here(games: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("ROSE_TEXTWORLD_GAMES", str(games))
    return games


def test_tw_make_makes_a_game_once_and_its_walkthrough_wins(games_here: Path) -> None:
    games = games_here
    path = make_game(2, 4, 2, seed=1, directory=games)
    assert path.is_file() and make_game(2, 4, 2, seed=1, directory=games) == path  # kept
    walkthrough = json.loads(path.with_suffix(".json").read_text())["metadata"]["walkthrough"]
    env = make_env("textworld", games=2)
    env.seeds = [1]  # the game above
    observation = env.reset(0)
    assert "Commands: " in observation
    total = 0.0
    for command in walkthrough:
        result = env.step(f"I will {command}.")
        assert result.info["command"] == command
        total += result.reward
        if result.done:
            break
    assert result.done and result.info["success"] and total == pytest.approx(1.0)
    assert env._game is None  # its process ended with the game


def test_a_reply_the_game_does_not_know_is_an_observation(games_here: Path, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    make_game(2, 4, 2, seed=1, directory=games_here)
    monkeypatch.chdir(tmp_path)
    env = make_env("textworld", games=2, max_turns=4)
    env.seeds = [1]
    env.reset(0)
    first = env.step("xyzzy frobnicate")
    assert not first.done and first.reward == 0.0 and first.observation
    escaped = env.step("\\x\\help")  # the interpreter's own escapes: typed as letters, answered
    assert not escaped.done and escaped.info["command"] == "x help"
    saved = env.step("save")  # the interpreter writes its save file in the game's scratch directory
    assert not saved.done and list(tmp_path.iterdir()) == []
    last = env.step("")
    assert last.done and last.info["truncated"] and not last.info["success"]


def test_textworld_holds_out_games_by_seed() -> None:
    train, held = (make_env("textworld", games=10, split=s).seeds for s in ("train", "eval"))
    assert held == [0, 5] and train == [1, 2, 3, 4, 6, 7, 8, 9]
    with pytest.raises(ValueError, match="no train game among 1"):
        make_env("textworld", games=1, split="train")
    assert match_command("I open the chest now", ["open chest", "open the chest", "look"]) == "open the chest"
    assert match_command("  go west\nthen east", ["look"]) == "go west"
    assert match_command("\\help \x00me", ["look"]) == "help  me"  # no escape reaches the interpreter
