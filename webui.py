"""Start the training-job web UI (docs/webui.md):

    python webui.py --host 127.0.0.1 --port 7860 --jobs_dir jobs/ [--token T]
"""

import sys

from webui.server import main

if __name__ == "__main__":
    sys.exit(main())
