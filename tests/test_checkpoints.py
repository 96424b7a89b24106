"""Save cadence, file names and retention (sd-scripts' rules)."""

from library.train import checkpoints as ckpt


def test_file_names():
    assert ckpt.epoch_stem("lora", 3) == "lora-000003"
    assert ckpt.step_stem("lora", 500) == "lora-step00000500"
    assert ckpt.model_path("out", "lora-000003", "safetensors") == "out/lora-000003.safetensors"
    assert ckpt.state_path("out", "lora-step00000500") == "out/lora-step00000500-state"


def test_epoch_cadence_skips_the_last_epoch_and_rotates():
    plan = ckpt.SavePlan(every_n_epochs=2, last_n_epochs=2)
    assert [e for e in range(1, 11) if plan.save_at_epoch(e, 10)] == [2, 4, 6, 8]
    assert [plan.epoch_to_remove(e, for_state=False) for e in (2, 4, 6, 8)] == [None, None, 2, 4]
    assert plan.epoch_to_remove(6, for_state=True) == 2  # state retention follows the model's by default


def test_step_cadence_and_window():
    plan = ckpt.SavePlan(every_n_steps=100, last_n_steps=250, last_n_steps_state=100)
    assert [s for s in range(100, 1001, 100) if plan.save_at_step(s, 1000)] == list(range(100, 1000, 100))
    # sd-scripts: at step s remove the save at (s - window - 1) rounded down to the cadence.
    assert [plan.step_to_remove(s, for_state=False) for s in (100, 300, 400, 500)] == [None, None, 100, 200]
    assert [plan.step_to_remove(s, for_state=True) for s in (100, 200, 300)] == [None, None, 100]
