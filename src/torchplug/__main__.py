import sys

from torchplug.core.cli import main

sys.exit(main())
