"""localmoe.tui: the `localmoe chat` terminal app (Textual). Entry point: `localmoe.tui.app.run_chat`."""
