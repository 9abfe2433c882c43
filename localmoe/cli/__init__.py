"""The `localmoe` command line: argument parsing, one function per subcommand, and the one-line error contract
(`localmoe: error: …` on stderr, exit 2 for bad input, 1 for runtime failures, a traceback only with --debug).

    main.py      main(): parse, dispatch, the error contract, exit statuses (the `localmoe` script's entry point)
    parser.py    build_parser(): the subcommands and the flags each takes
    flags.py     the flag groups subcommands share (each help states its default), the value validators
    terminal.py  stderr notices, the progress line, SIGTERM, a closed or abandoned pipe, quiet libraries
    inputs.py    the user's text checked before the load: PROMPT/stdin, --system, --stop, text files
    loading.py   flags into an Engine and the reply's generation settings; unsupported models refused
    run.py       `run` and its stats line          catalog.py  `models`, `show`, `pull`
    chat.py      `chat` (starts localmoe.tui)      measure.py  `calibrate`, `eval`, `bench`
    serve.py     `serve` (starts localmoe.server)

Within cli, imports run main -> subcommands (run, catalog, chat, measure, serve) -> loading -> inputs -> terminal, and
parser -> flags stand alone. May import every part of localmoe and localmoe.tui; nothing imports it except
`localmoe.__main__`. Heavy parts (torch, the engine, the tui) are imported inside the subcommand that needs them so
that `--help` and `models` stay instant.
"""
