"""The one checkpoint layout (fleet.storage.layout): naming, the ``latest`` pointer committed and
resolved safely, parent chains followed with a cycle and depth check, and pruning (files only)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

import fleet
import fleet.api
from fleet.errors import FleetError
from fleet.storage.layout import LATEST, MANIFEST, SAVES, STEPS, Layout, LayoutError, Save, SaveKind, follow


def saved(dirname: Path, kind: SaveKind, number: int | None = None, parent: str | None = None) -> str:
    """A committed save with one part; its path."""
    writer = Layout(str(dirname), kind).writer(number).prepare()
    writer.write("part.pt", {"number": writer.number})
    writer.commit(parent)
    return writer.path


def test_each_kind_names_its_saves_as_on_disk_today(tmp_path: Path) -> None:
    assert STEPS.name(12) == "step-000000012" and SAVES.name(3) == "save-000003"
    assert STEPS.number("step-000000012") == 12 and SAVES.number("save-000003") == 3
    assert STEPS.number("save-000003") is None and SAVES.number("step-000000012") is None
    assert STEPS.number("step-1234567890") == 1234567890  # past the padding: still a save
    assert STEPS.number("step-") is None and STEPS.number("step-12/x") is None
    with pytest.raises(ValueError, match="not negative"):
        STEPS.name(-1)
    steps, saves = Layout(str(tmp_path), STEPS), Layout(str(tmp_path), SAVES)
    assert steps.writer(7).path == str(tmp_path / "step-000000007")
    assert saves.writer().path == str(tmp_path / "save-000001")  # none yet
    saves.writer(4).prepare()  # unfinished: the next one is numbered above it all the same
    assert saves.writer().path == str(tmp_path / "save-000005")
    assert steps.numbers() == [] and saves.numbers() == [4]


def test_a_part_is_a_name_inside_the_save(tmp_path: Path) -> None:
    save = Save(str(tmp_path / "step-000000001"), STEPS)
    assert save.part("meta.pt") == str(tmp_path / "step-000000001" / "meta.pt")
    for bad in ("", ".", "..", "../meta.pt", "a/b", "/etc/passwd"):
        with pytest.raises(ValueError, match="a name inside it"):
            save.part(bad)


def test_commit_moves_latest_atomically_and_only_at_commit(tmp_path: Path) -> None:
    steps = Layout(str(tmp_path), STEPS)
    first = saved(tmp_path, STEPS, 1)
    writer = steps.writer(2).prepare()
    writer.write("part.pt", {"x": torch.ones(2)})
    assert (tmp_path / LATEST).read_text() == "step-000000001"  # every part written, not yet committed
    assert steps.resolve().path == first and not steps.committed("step-000000002")
    writer.commit()
    assert (tmp_path / LATEST).read_text() == "step-000000002"
    assert steps.committed("step-000000002") and steps.committed("step-000000001")
    assert torch.equal(steps.resolve().load("part.pt")["x"], torch.ones(2))
    assert not [p for p in tmp_path.rglob("*.tmp-*")]
    assert not (tmp_path / "step-000000002" / MANIFEST).exists()  # steps have no parents: no manifest
    with pytest.raises(ValueError, match="no parents"):
        steps.writer(3).prepare().commit(parent=first)
    base = saved(tmp_path / "ps", SAVES)
    delta = saved(tmp_path / "ps", SAVES, parent=base)
    assert json.loads(Path(delta, MANIFEST).read_text()) == {"parent": base}
    assert Save(delta, SAVES).parent() == base and Save(base, SAVES).parent() is None


def test_abort_removes_what_the_writer_wrote(tmp_path: Path) -> None:
    steps = Layout(str(tmp_path), STEPS)
    saved(tmp_path, STEPS, 1)
    shared = steps.writer(2).prepare()
    other = tmp_path / "step-000000002" / "worker-1.pt"  # another worker's part of the same save
    torch.save({}, other)
    shared.write("worker-0.pt", {})
    shared.abort(whole=False)
    assert sorted(os.listdir(tmp_path / "step-000000002")) == ["worker-1.pt"]
    alone = steps.writer(3).prepare()
    alone.write("worker-0.pt", {})
    assert alone.fresh
    alone.abort(whole=True)
    assert not (tmp_path / "step-000000003").exists()
    assert (tmp_path / LATEST).read_text() == "step-000000001"


@pytest.mark.parametrize(
    ("pointer", "wrong"),
    [
        ("", "it is empty"),
        ("\n", "it is empty"),
        ("/etc", "an absolute path"),
        ("../elsewhere/step-000000001", "a path, not the name of a save"),
        ("..", "a path, not the name of a save"),
        ("step-000000001/..", "a path, not the name of a save"),
        ("save-000001", "not named step-<n>"),
        ("step-000000009", "there is no such directory"),
    ],
)
def test_resolve_refuses_a_pointer_that_names_no_save_here(tmp_path: Path, pointer: str, wrong: str) -> None:
    ckpt = tmp_path / "ckpt"
    saved(ckpt, STEPS, 1)
    (tmp_path / "elsewhere" / "step-000000001").mkdir(parents=True)
    (ckpt / "save-000001").mkdir()
    (ckpt / LATEST).write_text(pointer)
    with pytest.raises(LayoutError, match="not a save") as caught:
        Layout(str(ckpt), STEPS).resolve()
    assert str(ckpt / LATEST) in str(caught.value) and wrong in str(caught.value), caught.value


def test_resolve_refuses_a_save_that_links_outside(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "step-000000001").symlink_to(outside, target_is_directory=True)
    (ckpt / LATEST).write_text("step-000000001")
    with pytest.raises(LayoutError, match="a link to a directory outside it"):
        Layout(str(ckpt), STEPS).resolve()


def test_resolve_without_a_pointer_is_none(tmp_path: Path) -> None:
    assert Layout(str(tmp_path), STEPS).resolve() is None
    assert Layout(str(tmp_path / "absent"), SAVES).resolve() is None


def test_follow_stops_at_a_cycle_and_at_the_depth_bound() -> None:
    parents = {"c": "b", "b": "a", "a": None}
    assert follow("c", parents.get) == ["c", "b", "a"]
    loop = {"c": "b", "b": "a", "a": "c"}
    with pytest.raises(LayoutError, match=r"already read \(a cycle\): c -> b -> a -> c"):
        follow("c", loop.get)
    with pytest.raises(LayoutError, match="more than 3 saves"):
        follow("s5", lambda s: f"s{int(s[1:]) - 1}" if s != "s0" else None, max_depth=3)
    assert follow("s3", lambda s: f"s{int(s[1:]) - 1}" if s != "s0" else None, max_depth=3) == ["s3", "s2", "s1", "s0"]


def test_a_cycle_in_saves_manifests_is_an_error_naming_the_saves(tmp_path: Path) -> None:
    base = saved(tmp_path, SAVES)
    delta = saved(tmp_path, SAVES, parent=base)
    Path(base, MANIFEST).write_text(json.dumps({"parent": delta}))  # edited into a loop
    saves = Layout(str(tmp_path), SAVES)
    with pytest.raises(LayoutError, match="a cycle") as caught:
        saves.chain(saves.resolve())
    assert base in str(caught.value) and delta in str(caught.value)


def test_pruning_keeps_the_newest_and_every_save_the_newest_builds_on(tmp_path: Path) -> None:
    base = saved(tmp_path, SAVES)
    other = saved(tmp_path, SAVES)  # a base of its own
    delta1 = saved(tmp_path, SAVES, parent=base)
    delta2 = saved(tmp_path, SAVES, parent=delta1)
    names = sorted(os.listdir(tmp_path))
    assert names == sorted([LATEST, *(os.path.basename(p) for p in (base, delta1, delta2))]), names
    assert not os.path.exists(other)  # neither among the newest two nor a parent of the newest
    saves = Layout(str(tmp_path), SAVES)
    assert [s.path for s in saves.chain(saves.resolve())] == [delta2, delta1, base]


def test_pruning_keeps_the_newest_complete_saves_and_drops_unfinished_ones_above(tmp_path: Path) -> None:
    for step in (1, 2, 3):
        saved(tmp_path, STEPS, step)
    assert sorted(os.listdir(tmp_path)) == [LATEST, "step-000000002", "step-000000003"]
    Layout(str(tmp_path), STEPS).writer(9).prepare()  # a save that never completed
    saved(tmp_path, STEPS, 4)
    assert sorted(os.listdir(tmp_path)) == [LATEST, "step-000000003", "step-000000004"]


def test_pruning_with_a_broken_chain_removes_nothing(tmp_path: Path) -> None:
    base = saved(tmp_path, SAVES)
    delta = saved(tmp_path, SAVES, parent=base)
    Path(base, MANIFEST).write_text(json.dumps({"parent": delta}))
    Layout(str(tmp_path), SAVES).writer().prepare()
    saved(tmp_path, SAVES, parent=delta)  # commits; the chain loops, so every save stays
    assert len(Layout(str(tmp_path), SAVES).numbers()) == 4


def test_a_parent_in_another_directory_is_neither_kept_nor_removed_here(tmp_path: Path) -> None:
    base = saved(tmp_path / "daily", SAVES)
    for _ in range(3):
        saved(tmp_path / "hourly", SAVES, parent=base)
    assert os.path.isdir(base) and Layout(str(tmp_path / "hourly"), SAVES).numbers() == [2, 3]


@pytest.mark.parametrize("pointer", ["../outside/step-000000001", "ABSOLUTE", "step-000000001/../../outside"])
def test_load_checkpoint_refuses_a_latest_outside_the_directory(tmp_path: Path, monkeypatch, pointer: str) -> None:
    for name in ("FLEET_ROLE", "RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    fleet.api._reset_for_tests()
    try:
        fleet.init()
        model = torch.nn.Linear(2, 2)
        opt = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
        fleet.save_checkpoint(str(tmp_path / "outside"), model, opt, 1)  # a real checkpoint, elsewhere
        ckpt = tmp_path / "ckpt"
        fleet.save_checkpoint(str(ckpt), model, opt, 1)
        pointer = str(tmp_path / "outside" / "step-000000001") if pointer == "ABSOLUTE" else pointer
        (ckpt / LATEST).write_text(pointer)
        with pytest.raises(FleetError, match="not a save") as caught:
            fleet.load_checkpoint(str(ckpt), model, opt)
        assert str(ckpt / LATEST) in str(caught.value) and repr(pointer) in str(caught.value), caught.value
    finally:
        fleet.api._reset_for_tests()
