"""`python -m app`: the same as the `matmul-service` command, where the console script is not installed."""

import sys

from app.cli import service_main

sys.exit(service_main())
