"""``python -m torchplug_torchft launch ...`` (see `torchplug_torchft.launch`)."""

import sys

from torchplug_torchft.launch import USAGE, launch

if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] != "launch":
        print(f"usage: {USAGE}", file=sys.stderr)
        sys.exit(2)
    sys.exit(launch(sys.argv[2:]))
