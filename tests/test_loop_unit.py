"""The training loop alone (library/train/loop.py), on fakes: a one-weight step module, planned batches of plain
dicts, a saver that records what it was asked to write. No family, no dataset, no files."""

import contextlib
import os
import signal
from types import SimpleNamespace

import pytest
import torch

from library.train.control import control_dir
from library.train.distributed.distributed import StepTrace
from library.train.loop import InterruptedTraining, TrainingError, TrainingLoop
from library.train.observe.profiling import Instruments
from library.train.settings import TrainingOptions
from library.train.state import RunState, TrainProgress


class OneWeight(torch.nn.Module):
    """loss = (w - batch target)^2: a step module whose every step is predictable."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(()))

    def forward(self, batch, generator):
        return (self.w - batch["latents"].mean()) ** 2, None


class FakeData:
    """`per_epoch` batches per epoch, each one image with target 1.0 (or NaN at `nan_at` = (epoch, index))."""

    def __init__(self, per_epoch: int, epochs: int, nan_at=None):
        self.per_epoch, self.epochs, self.nan_at = per_epoch, epochs, nan_at
        self.num_train_images = per_epoch
        self.asked: list[tuple[int, int]] = []  # (epoch, global step) of every epoch_batches call

    def epoch_batches(self, epoch: int, global_step: int):
        self.asked.append((epoch, global_step))
        return [(epoch, i) for i in range(self.per_epoch)]

    def load_batch(self, ref):
        target = float("nan") if ref == self.nan_at else 1.0
        return {"image_paths": [f"e{ref[0]}_b{ref[1]}.png"], "skipped_images": [],
                "latents": torch.full((1, 4, 2, 2), target)}

    def num_epochs(self) -> int:
        return self.epochs


class FakeSaver:
    def __init__(self, save_every_n_steps=None):
        self.every = save_every_n_steps
        self.calls: list[tuple] = []

    def after_step(self, step):
        self.calls.append(("step", step))
        if self.every and step % self.every == 0:
            self.calls.append(("save", step))

    def after_epoch(self, epoch, step):
        self.calls.append(("epoch", epoch, step))

    def save_model(self, stem, step, epoch):
        self.calls.append(("model", stem, step, epoch))

    def save_state(self, state_dir, progress):
        self.calls.append(("state", state_dir, progress))

    def final(self, progress):
        self.calls.append(("final", progress))
        return "final.safetensors"


class FakeStop:
    def __init__(self, at_step=None, loop=None):
        self.at_step, self.loop = at_step, loop
        self.signum, self.why = signal.SIGINT, None

    @property
    def requested(self) -> bool:
        return self.at_step is not None and self.loop.run_state.progress.global_step >= self.at_step


class FakeTracker:
    def __init__(self):
        self.logged: list[tuple[dict, int]] = []

    def log(self, values, step):
        self.logged.append((dict(values), step))


class FakeTrainable:
    is_adapter = True
    sharding = None

    def __init__(self, module):
        self.module = module
        self.epochs_started = 0

    def on_epoch_start(self):
        self.epochs_started += 1

    def weights(self):
        return dict(self.module.named_parameters())

    def before_optimizer_step(self):
        pass

    def after_optimizer_step(self, device):
        return {}


class Loop(TrainingLoop):
    """A TrainingLoop with the attributes Trainer's setup would fill in, made of fakes."""

    def __init__(self, tmp_path, per_epoch=4, epochs=2, max_steps=None, accum=1, stop_at=None, nan_at=None,
                 save_every=None, progress=None):
        self.t = TrainingOptions(output_dir=str(tmp_path), output_name="run", seed=1,
                                 gradient_accumulation_steps=accum, log_every_n_steps=1)
        self.s = SimpleNamespace(
            data=SimpleNamespace(data_loader_workers=lambda: 0, persistent_data_loader_workers=False,
                                 validation_seed=None),
            optimizer=SimpleNamespace(max_grad_norm=None), hooks=[], no_half_vae=False,
            ema=SimpleNamespace(for_sampling=True, for_validation=True))
        self.data = FakeData(per_epoch, epochs, nan_at)
        self.batches_per_epoch = per_epoch
        self.num_epochs = epochs
        self.max_train_steps = max_steps if max_steps is not None else epochs * per_epoch // accum
        self.network = self.step_module = OneWeight()
        self.trainable = FakeTrainable(self.network)
        self.optimizer = torch.optim.SGD(self.network.parameters(), lr=0.25)
        self.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda _: 1.0)
        self.lr_names = ["lr/unet"]
        self.optimizer_descr = SimpleNamespace(adaptive=False)
        self.schedule_free = self.fused_backward = False
        self.zero = self.block_swapper = self.ema = None
        self.device = torch.device("cpu")
        self.accelerator = SimpleNamespace(is_local_main_process=False, is_main_process=True, num_processes=1,
                                           sync_gradients=True,
                                           backward=lambda loss: loss.backward(),
                                           clip_grad_norm_=torch.nn.utils.clip_grad_norm_)
        self.run_state = RunState.start(1)
        if progress is not None:
            self.run_state.progress = progress
        self.noise_generator = self.run_state.noise_generator
        self.instruments = Instruments(None, None, None)
        self.trace = StepTrace(0)
        self.skipped_images = set()
        self.tracker = FakeTracker()
        self.saver = FakeSaver(save_every)
        self.stop = FakeStop(stop_at, self)
        self.ctx = None


def steps_seen(loop):
    return [c[1] for c in loop.saver.calls if c[0] == "step"]


def test_every_batch_is_one_optimizer_step_and_the_run_ends_with_the_final_save(tmp_path):
    loop = Loop(tmp_path, per_epoch=4, epochs=2)
    assert loop._train() == "final.safetensors"
    assert steps_seen(loop) == [1, 2, 3, 4, 5, 6, 7, 8]
    assert ("epoch", 1, 4) in loop.saver.calls and ("epoch", 2, 8) in loop.saver.calls
    assert loop.saver.calls[-1] == ("final", TrainProgress(epoch=3, global_step=8, batches_done=0))
    assert loop.data.asked == [(1, 0), (2, 4)]
    assert loop.trainable.epochs_started == 2
    # SGD on (w - 1)^2 with lr 0.25 halves the distance to 1 at every step: w = 1 - 0.5^8
    assert loop.network.w.item() == pytest.approx(1 - 0.5 ** 8, abs=1e-7)
    assert [step for _, step in loop.tracker.logged if _.get("loss/epoch_average") is None] == list(range(1, 9))


def test_gradient_accumulation_steps_once_per_group(tmp_path):
    loop = Loop(tmp_path, per_epoch=4, epochs=2, accum=2)
    loop._train()
    assert steps_seen(loop) == [1, 2, 3, 4]
    # two equal micro-batch gradients, each divided by 2: the same update as one batch
    assert loop.network.w.item() == pytest.approx(1 - 0.5 ** 4, abs=1e-7)


def test_max_train_steps_ends_mid_epoch_and_records_where(tmp_path):
    loop = Loop(tmp_path, per_epoch=4, epochs=2, max_steps=3)
    loop._train()
    assert steps_seen(loop) == [1, 2, 3]
    assert [c for c in loop.saver.calls if c[0] == "epoch"] == [("epoch", 1, 3)]
    assert loop.saver.calls[-1] == ("final", TrainProgress(epoch=1, global_step=3, batches_done=3))


def test_save_cadence_is_the_savers_after_every_step(tmp_path):
    loop = Loop(tmp_path, per_epoch=3, epochs=2, save_every=2)
    loop._train()
    assert [c[1] for c in loop.saver.calls if c[0] == "save"] == [2, 4, 6]


def test_a_stop_request_is_honoured_after_the_step_it_arrived_in(tmp_path):
    loop = Loop(tmp_path, per_epoch=4, epochs=2, stop_at=2)
    with pytest.raises(InterruptedTraining) as info:
        loop._train()
    assert steps_seen(loop) == [1, 2]
    state_dir = str(tmp_path / "run-step00000002-state")
    assert loop.saver.calls[-1] == ("state", state_dir, TrainProgress(epoch=1, global_step=2, batches_done=2))
    assert info.value.signum == signal.SIGINT and info.value.state_dir == state_dir
    assert loop.network.w.item() == pytest.approx(1 - 0.5 ** 2, abs=1e-7)  # no third update before the save


def test_resume_skips_the_batches_already_done(tmp_path):
    loop = Loop(tmp_path, per_epoch=4, epochs=2, progress=TrainProgress(epoch=1, global_step=3, batches_done=3))
    loop._train()
    assert steps_seen(loop) == [4, 5, 6, 7, 8]
    assert loop.data.asked == [(1, 0), (2, 4)]  # epoch 1's plan is asked for as of its first step


def test_a_non_finite_loss_stops_before_its_step_and_names_the_batch(tmp_path):
    loop = Loop(tmp_path, per_epoch=4, epochs=1, nan_at=(1, 2))
    with pytest.raises(TrainingError, match=r"^step 3: loss is nan \(not finite\); stopping\. "
                                            r"Images in this batch: e1_b2\.png\."):
        loop._train()
    assert steps_seen(loop) == [1, 2]
    assert not any(c[0] in ("final", "state") for c in loop.saver.calls)


def test_eval_weights_swaps_in_the_ema_only_when_asked(tmp_path):
    loop = Loop(tmp_path)
    assert isinstance(loop.eval_weights("sampling"), contextlib.nullcontext)
    swapped = []
    loop.ema = SimpleNamespace(swapped_in=lambda: swapped.append(1) or contextlib.nullcontext())
    loop.s.ema.for_validation = False
    assert isinstance(loop.eval_weights("validation"), contextlib.nullcontext) and swapped == []
    loop.eval_weights("sampling")
    assert swapped == [1]


def test_a_save_now_request_is_served_after_the_next_step_and_taken_once(tmp_path):
    loop = Loop(tmp_path, per_epoch=3, epochs=1)
    os.makedirs(control_dir(str(tmp_path)))
    open(os.path.join(control_dir(str(tmp_path)), "save"), "w").close()
    loop._train()
    assert [c for c in loop.saver.calls if c[0] == "model"] == [("model", "run-step00000001", 1, 1)]
    assert os.listdir(control_dir(str(tmp_path))) == []
