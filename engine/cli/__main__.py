"""``python -m engine.cli ...`` runs the ``tandem`` command."""

import sys

from engine.cli import main

sys.exit(main())
