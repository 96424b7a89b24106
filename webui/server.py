"""Command line of the web UI: python webui.py --host 127.0.0.1 --port 7860 --jobs_dir jobs/ [--token T]"""

from __future__ import annotations

import argparse
import os
import sys
import threading
from typing import Optional, Sequence

from webui.desktop import is_loopback


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="Web UI for training jobs: create, run, watch and manage them from a browser")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default loopback; any other needs --token)")
    p.add_argument("--port", type=int, default=7860)
    p.add_argument("--jobs_dir", default="jobs", help="folder of the jobs database and one folder per job")
    p.add_argument("--token", default=os.environ.get("WEBUI_TOKEN"),
                   help="required on every request (?token= once in the browser, or 'Authorization: Bearer'); "
                        "default: $WEBUI_TOKEN")
    p.add_argument("--launcher", choices=("python", "accelerate"), default="python",
                   help="how new jobs run their script: 'python <script>' or 'accelerate launch <script>'")
    p.add_argument("--data_root", action="append", default=None,
                   help="a folder the datasets may be in and the folder picker may show (repeat for several; "
                        "default: the toolkit's folder and the current one)")
    p.add_argument("--stop_timeout", type=float, default=60.0,
                   help="seconds between Stop's SIGINT (the trainer saves a state) and SIGTERM")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    if not is_loopback(args.host) and not args.token:
        print(f"error: --host {args.host} is not a loopback address: give --token (or set WEBUI_TOKEN) so that "
              "only you can start processes on this machine", file=sys.stderr)
        return 2
    import uvicorn

    from webui.app import create_app

    app = create_app(args.jobs_dir, token=args.token, stop_timeout=args.stop_timeout,
                     default_launcher=args.launcher, data_roots=args.data_root)
    stop = threading.Event()

    def watch() -> None:  # statuses and the queue move on even when no page is open
        while not stop.wait(1.0):
            app.state.runner.refresh()

    threading.Thread(target=watch, daemon=True).start()

    def learn_trainer_flags() -> None:  # the Performance options' first look needs each script's --describe_flags
        from webui.families import FamiliesUnknown, all_scripts
        from webui.performance import trainer_description

        try:
            scripts = all_scripts()
        except FamiliesUnknown:
            return  # asked again (and reported) by the first request that needs the families
        for script in scripts:
            trainer_description(script)

    threading.Thread(target=learn_trainer_flags, daemon=True).start()
    print(f"Training jobs UI on http://{args.host}:{args.port}/ (jobs in {os.path.abspath(args.jobs_dir)})", flush=True)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    finally:
        stop.set()
        app.state.tensorboards.stop_all()  # training runs go on: they are detached from the server
    return 0
