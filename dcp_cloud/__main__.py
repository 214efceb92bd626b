"""``python -m dcp_cloud``: the ``dcp-cloud`` command."""

import sys

from .cli.main import main

sys.exit(main())
