"""`python -m moestream ...` is the `moestream` command."""
import sys

from .cli import main

sys.exit(main())
