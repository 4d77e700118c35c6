import sys

from infero.cli import main

sys.exit(main())
