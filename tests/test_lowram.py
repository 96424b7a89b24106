"""--lowram: the processes of one machine load the model in turns (local rank 0 first, a barrier after each
turn), as sd-scripts does; with one process, or without the flag, loading is one plain call."""

from __future__ import annotations

from library.train.distributed.distributed import load_in_turns


class Machine:
    """Two processes of one machine, run here one call at a time: a barrier is a point both must reach."""

    def __init__(self, processes: int):
        self.events: list[tuple] = []
        self.processes = processes

    def process(self, rank: int):
        machine = self

        class Accelerator:
            num_processes = machine.processes
            local_process_index = rank

            def wait_for_everyone(self):
                machine.events.append(("barrier", rank))

        return Accelerator()


def test_processes_load_one_after_another(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    machine = Machine(2)
    for rank in (0, 1):
        got = load_in_turns(lambda rank=rank: machine.events.append(("load", rank)) or f"model{rank}",
                            machine.process(rank), enabled=True)
        assert got == f"model{rank}"
    # rank 0 loads in turn 0, then both meet; rank 1 meets first, then loads in turn 1, then both meet
    assert machine.events == [("load", 0), ("barrier", 0), ("barrier", 0),
                              ("barrier", 1), ("load", 1), ("barrier", 1)]


def test_one_process_or_no_flag_loads_once_without_barriers(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    for processes, enabled in ((1, True), (2, False)):
        machine = Machine(processes)
        assert load_in_turns(lambda: "model", machine.process(0), enabled) == "model"
        assert machine.events == []


def test_lowram_reaches_the_settings(tmp_path):
    from library.cli.entry import build_parser, settings_from_args
    from library.families import get_family

    family = get_family("sd")
    base = ["--pretrained_model_name_or_path", "tiny:sd1", "--output_dir", str(tmp_path),
            "--train_data_dir", str(tmp_path)]
    assert settings_from_args(build_parser("", family).parse_args(base + ["--lowram"]), family).training.lowram
    assert not settings_from_args(build_parser("", family).parse_args(base), family).training.lowram
