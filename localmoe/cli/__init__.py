"""The `localmoe` command line: argument parsing, one function per subcommand, and the one-line error contract
(`localmoe: error: …` on stderr, exit 2 for bad input, 1 for runtime failures, a traceback only with --debug).

May import every part of localmoe and localmoe.tui; nothing imports it except `localmoe.__main__`. Heavy parts
(torch, the engine) are imported inside the subcommand that needs them so that `--help` stays instant.
"""
