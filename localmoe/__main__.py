"""`python -m localmoe` entry point."""

from localmoe.cli import main

raise SystemExit(main())
