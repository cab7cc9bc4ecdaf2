import sys

from torchplug.cli import main

sys.exit(main())
