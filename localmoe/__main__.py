"""`python -m localmoe` entry point."""

from localmoe.cli.main import main

raise SystemExit(main())
