"""The process the UI starts for a run: `python -m webui.launch EXIT_CODE_FILE -- ARGV...`.

It runs ARGV (the training command) in the same process group and writes its exit code to EXIT_CODE_FILE
(atomically) when it ends, so that a UI server started later still learns how a run ended. It survives
the stop signals the UI sends to the group (the trainer gets them and saves a state); standard library only.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[1] != "--":
        print("usage: python -m webui.launch EXIT_CODE_FILE -- COMMAND...", file=sys.stderr)
        return 2
    exit_file, command = argv[0], argv[2:]
    for sig in (signal.SIGINT, signal.SIGTERM):  # a handler (not SIG_IGN): the child starts with the default
        signal.signal(sig, lambda signum, frame: None)
    try:
        child = subprocess.Popen(command)
    except OSError as e:
        print(f"error: cannot start {command[0]}: {e}", flush=True)
        code = 127
    else:
        while True:
            try:
                code = child.wait()
                break
            except InterruptedError:
                continue
        if code < 0:
            code = 128 - code
    tmp = f"{exit_file}.{os.getpid()}.tmp"
    if os.path.islink(tmp):  # never write through a link planted in the job's folder
        os.unlink(tmp)
    with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o666), "w",
                   encoding="utf-8") as f:
        f.write(f"{code}\n")
    os.replace(tmp, exit_file)
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
