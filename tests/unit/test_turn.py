"""Round robin's turn shared by a node's ingresses (router/turn.py): tickets from one file, in
draw order, across processes, and a turn of its own when the file cannot be written."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from router import turn as turn_module
from router.pickers import RoundRobinPicker
from router.turn import SharedTurn, local_turn, shared_turn

ROOT = Path(__file__).resolve().parents[2]


def test_tickets_of_two_turns_on_one_file_follow_the_draws(tmp_path: Path) -> None:
    a, b = SharedTurn(tmp_path / "t"), SharedTurn(tmp_path / "t")
    assert [a(), b(), a(), a(), b()] == [1, 2, 3, 4, 5]


def test_processes_drawing_at_once_never_share_a_ticket(tmp_path: Path) -> None:
    draw = ("import sys; from pathlib import Path; from router.turn import SharedTurn; "
            "t = SharedTurn(Path(sys.argv[1])); print(' '.join(str(t()) for _ in range(2000)))")
    procs = [subprocess.Popen([sys.executable, "-c", draw, str(tmp_path / "t")], cwd=ROOT,
                              stdout=subprocess.PIPE, text=True) for _ in range(3)]
    tickets = [int(t) for proc in procs for t in proc.communicate(timeout=60)[0].split()]
    assert sorted(tickets) == list(range(1, 6001))


def test_the_file_is_emptied_past_its_bound(tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(turn_module, "WRAP_BYTES", 3)
    turn = SharedTurn(tmp_path / "t")
    assert [turn() for _ in range(7)] == [1, 2, 3, 1, 2, 3, 1]
    assert (tmp_path / "t").stat().st_size == 1


def test_an_unwritable_turn_becomes_the_process_own(tmp_path: Path,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / "file").write_text("")
    turn = SharedTurn(tmp_path / "file" / "t")  # its directory is a file
    assert [turn(), turn(), turn()] == [0, 1, 2]
    assert "turn of its own" in caplog.text and str(tmp_path / "file" / "t") in caplog.text


def test_a_turn_is_never_drawn_through_another_user_s_directory_or_a_link(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    victim = tmp_path / "victim"
    victim.write_text("kept")
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)  # as a directory planted in /dev/shm for others to write
    assert [SharedTurn(shared / "t")() for _ in range(2)] == [0, 0]  # each a turn of its own
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    (private / "t").symlink_to(victim)
    turn = SharedTurn(private / "t")
    assert [turn(), turn()] == [0, 1]
    assert victim.read_text() == "kept"
    assert "this user's alone" in caplog.text


def test_turns_are_per_application_and_pool(tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TOKENFAB_TURN_DIR", str(tmp_path))
    main, other, elsewhere = shared_turn("app", "main"), shared_turn("app", "other"), \
        shared_turn("app/x", "main")
    assert [main(), main(), other(), elsewhere()] == [1, 2, 1, 1]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "app--main.turn", "app--other.turn", "app_x--main.turn"]


@pytest.mark.parametrize(("shared", "first_choices"), [
    (True, ["b", "a", "b", "a", "b", "a"]),  # one turn: strictly alternating
    (False, ["a", "a", "b", "b", "a", "a"]),  # a turn each: the same replica twice in a row
])
def test_two_ingresses_alternate_only_on_a_shared_turn(tmp_path: Path, shared: bool,
                                                       first_choices: list[str]) -> None:
    turns = [SharedTurn(tmp_path / "t"), SharedTurn(tmp_path / "t")] if shared \
        else [local_turn(), local_turn()]
    pickers = [RoundRobinPicker(turn) for turn in turns]
    chosen = [pickers[i % 2].rank_ids(["a", "b"])[0] for i in range(6)]
    assert chosen == first_choices
