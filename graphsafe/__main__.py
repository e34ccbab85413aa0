"""`python -m graphsafe` runs the command line."""

from graphsafe.cli import main

raise SystemExit(main())
