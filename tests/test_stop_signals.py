"""Stop requests a real `python train_network.py` gets from its first line on, and launchers that go away.

Each test runs the real entry script (or launcher) as a subprocess on the tiny SD1 preset; with one torch
thread they take a few seconds each.
"""

from __future__ import annotations

import glob
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import psutil
import pytest

from tests.train_helpers import base_args, make_dataset

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO)
LINUX = sys.platform.startswith("linux")
STOPPED_EARLY = "stopped by signal 2 before training started; nothing more was saved"


def _ignore_sigint():
    signal.signal(signal.SIGINT, signal.SIG_IGN)


@pytest.mark.parametrize("inherited", ["default", "ignored"])
def test_sigint_while_the_entry_script_imports_is_one_line_and_exit_130(tmp_path, inherited):
    """SIGINT 0.7 s after start, while torch and the library are imported (about 3 s here): one line, exit 130,
    nothing written. Before: a KeyboardInterrupt traceback and exit -2; inherited as ignored, the run trained to
    the end. Ignored stays overridden on purpose: the web UI and launchers stop runs with SIGINT."""
    data = make_dataset(str(tmp_path), n=1)
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "train_network.py", *base_args(data, str(out), steps=2)], cwd=REPO,
                            env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=_ignore_sigint if inherited == "ignored" else None)
    time.sleep(0.7)
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=120)
    assert (proc.returncode, stderr.strip().splitlines(), stdout) == (130, [STOPPED_EARLY], "")
    assert not out.exists() or os.listdir(out) == []


def test_a_second_sigint_while_importing_stops_at_once():
    """The first signal is kept for the run's handler; a second one before it takes over stops at once (nothing
    has been written yet). Two signals that arrive during one long C call (loading a library) count as one."""
    script = ("import os, signal, time\n"
              "from library.core import stop_signals\n"
              "stop_signals.install_at_start()\n"
              "os.kill(os.getpid(), signal.SIGINT)\n"
              "time.sleep(0.2)\n"
              "print('recorded, still going', flush=True)\n"
              "os.kill(os.getpid(), signal.SIGINT)\n"
              "time.sleep(30)\n"
              "print('not reached')\n")
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=ENV, capture_output=True, text=True,
                          timeout=20)
    assert (done.returncode, done.stdout, done.stderr) == (130, "recorded, still going\n", STOPPED_EARLY + "\n")


LAUNCHER = r'''
import os, subprocess, sys, threading, time
child = r"""
import os, sys, time
from library.core import stop_signals
stop_signals.install_at_start()
print("ready", os.getppid(), flush=True)
deadline = time.time() + 20
while time.time() < deadline:  # only the kernel's parent-death signal fills the record here
    first, _ = stop_signals.take_over()
    if first is not None:
        print("launcher gone", first, "%.3f" % time.time(), flush=True)
        break
    time.sleep(0.02)
"""
def start_child():
    # Started from a thread that ends once the child has set its parent-death signal, as a launcher's may: the
    # kernel then sends that signal although the launcher lives on; the child must not take it for its death.
    subprocess.Popen([sys.executable, "-c", child], stdout=sys.stdout)
    deadline = time.time() + 20
    while "ready" not in open(os.environ["LOG"]).read() and time.time() < deadline:  # the child has set it
        time.sleep(0.05)
    time.sleep(0.3)
t = threading.Thread(target=start_child)
t.start()
t.join()
print("thread ended %.3f" % time.time(), flush=True)
time.sleep(1.5)
print("launcher exits %.3f" % time.time(), flush=True)
os._exit(0)
'''


@pytest.mark.skipif(not LINUX, reason="prctl(PR_SET_PDEATHSIG) is Linux's")
def test_the_kernel_tells_a_launched_process_that_its_launcher_is_gone(tmp_path):
    """Nothing polls in the child: only PR_SET_PDEATHSIG can record the launcher's death. The end of the
    launcher's thread that started the child (1.5 s before the launcher exits; the kernel signals that too)
    must not count."""
    log = tmp_path / "log.txt"
    with open(log, "w") as f:
        launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER], cwd=REPO, stdout=f, stderr=subprocess.STDOUT,
                                    env=dict(ENV, LOCAL_RANK="0", LOG=str(log)))
        assert launcher.wait(timeout=60) == 0
    deadline = time.time() + 30
    while "launcher gone" not in log.read_text() and time.time() < deadline:
        time.sleep(0.1)
    text = log.read_text()
    gone = re.search(r"launcher gone (\d+) ([\d.]+)", text)
    assert gone, text
    assert int(gone.group(1)) == signal.SIGUSR2
    assert float(gone.group(2)) >= float(re.search(r"launcher exits ([\d.]+)", text).group(1)), text
    assert float(re.search(r"thread ended ([\d.]+)", text).group(1)) < float(gone.group(2)) - 1.0, text


def test_a_launched_run_stops_at_the_step_after_its_parent_changed(monkeypatch):
    """The portable check (any system, and a signal the kernel could not send): getppid() at every step."""
    from library.core import stop_signals
    from library.train.stopping import StopHandler

    monkeypatch.setenv("LOCAL_RANK", "0")
    launcher = os.getppid()
    stop = StopHandler().install()
    try:
        stop.in_loop = True
        assert (stop.launcher, stop.requested) == (launcher, False)
        monkeypatch.setattr(os, "getppid", lambda: 1)  # handed to init
        assert (stop.requested, stop.signum, stop.why) == (True, 1, f"because its launcher (pid {launcher}) is gone")
    finally:
        stop.uninstall()
    assert stop_signals.launcher_gone() is False  # no longer watched
    monkeypatch.setattr(os, "getppid", lambda: launcher)
    stop = StopHandler().install()
    try:  # SIGINT to the launcher's group (the web UI's Stop) also ends the launcher: not a second request
        stop.in_loop = True
        stop._on_signal(signal.SIGINT, None)
        monkeypatch.setattr(os, "getppid", lambda: 1)
        stop._on_signal(stop_signals.PARENT_DEATH_SIGNAL, None)  # raised StopRequested (no state saved) before
        assert (stop.requested, stop.signum, stop.why) == (True, signal.SIGINT, "by signal 2")
    finally:
        stop.uninstall()
    monkeypatch.delenv("LOCAL_RANK")
    plain = StopHandler().install()  # not launched: a parent that changes is not a stop
    try:
        plain.in_loop = True
        assert (plain.launcher, plain.requested) == (None, False)
    finally:
        plain.uninstall()


def test_a_process_the_signal_did_not_reach_stops_at_the_same_step_with_its_own_line(tmp_path, monkeypatch):
    """With several processes a signal may reach only some; the others stop at the same step (any_process). Such a
    process had no signal number: the entry script's 128 + signum was a TypeError traceback."""
    from library.train import loop
    from library.train.trainer import InterruptedTraining
    from tests.train_helpers import make_trainer

    monkeypatch.setattr(loop, "any_process", lambda flag, device=None: True)  # another process got SIGINT
    data = make_dataset(str(tmp_path), n=1)
    out = tmp_path / "out"
    with pytest.raises(InterruptedTraining) as stopped:
        make_trainer(base_args(data, str(out), steps=4)).run()
    state = str(out / "lora-step00000001-state")
    assert (stopped.value.signum, str(stopped.value)) == (signal.SIGTERM, (
        f"stopped because another process was asked to stop; state saved to {state} (resume with --resume {state})"))
    assert os.path.isfile(os.path.join(state, "train_state.json"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_gone(procs: list, timeout: float) -> list:
    """The processes (not our children: init reaps them) still running after `timeout` seconds."""
    deadline = time.time() + timeout
    while True:
        alive = [p for p in procs if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        if not alive or time.time() > deadline:
            return alive
        time.sleep(0.1)


def _launch_and_orphan(tmp_path, command: list[str], kill, workers_expected: int):
    """Start a 400-step run with a state every 3 steps; once the first state exists, `kill` the launcher only.
    Returns (the log, the state folders before, the state folders after, seconds the workers took to exit)."""
    data = make_dataset(str(tmp_path), n=1)
    out = tmp_path / "out"
    argv = base_args(data, str(out), steps=400, extra=["--save_state", "--save_every_n_steps", "3", "--cpu"])
    log = tmp_path / "log.txt"
    with open(log, "w") as f:
        launcher = subprocess.Popen(command + ["train_network.py", *argv], cwd=REPO, env=ENV, stdout=f,
                                    stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.time() + 120
    while not glob.glob(str(out / "*-state")) and time.time() < deadline and launcher.poll() is None:
        time.sleep(0.1)
    workers = psutil.Process(launcher.pid).children(recursive=True)
    before = sorted(glob.glob(str(out / "*-state")))
    assert before and len(workers) == workers_expected, log.read_text()
    killed = time.time()
    kill(launcher)
    launcher.wait(timeout=30)
    alive = _wait_gone(workers, timeout=60)
    took = time.time() - killed
    for w in alive:
        w.kill()
    assert not alive, f"workers still running 60 s after the launcher was killed:\n{log.read_text()[-3000:]}"
    return log.read_text(), launcher.pid, before, sorted(glob.glob(str(out / "*-state"))), took


def _assert_stopped_as_after_ctrl_c(text: str, launcher_pid: int, before, after, lines: int):
    stopped = re.findall(rf"^stopped because its launcher \(pid {launcher_pid}\) is gone; state saved to (\S+) "
                         r"\(resume with --resume \S+\)$", text, re.M)
    assert len(stopped) == lines, text[-3000:]
    assert stopped[0] in after
    with open(os.path.join(stopped[0], "train_state.json")) as f:
        step = json.load(f)["current_step"]  # the step it stopped at, no earlier than the states before the kill
    assert stopped[0].endswith(f"lora-step{step:08d}-state")
    assert max(int(re.search(r"step(\d+)-state", b).group(1)) for b in before) <= step < 400


def test_workers_stop_and_save_when_torchrun_is_killed(tmp_path):
    """SIGKILL to torchrun's process group (its 2 workers run in a session of their own): before, both trained
    on; now each stops at the same step, the state is saved once and each prints the one line."""
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
               "--master_port", str(_free_port())]
    text, pid, before, after, took = _launch_and_orphan(tmp_path, command,
                                                        lambda p: os.killpg(p.pid, signal.SIGKILL), 2)
    _assert_stopped_as_after_ctrl_c(text, pid, before, after, lines=2)
    assert "Traceback" not in text
    assert took < 60


def test_the_run_stops_and_saves_when_accelerate_launch_gets_sigint(tmp_path):
    """SIGINT to the pid of `accelerate launch` (one process) ends the launcher (accelerate's own traceback);
    before, the run trained on and kept saving states."""
    command = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "1", "--num_machines", "1",
               "--cpu", "--mixed_precision", "no", "--dynamo_backend", "no"]
    text, pid, before, after, took = _launch_and_orphan(tmp_path, command,
                                                        lambda p: os.kill(p.pid, signal.SIGINT), 1)
    _assert_stopped_as_after_ctrl_c(text, pid, before, after, lines=1)
