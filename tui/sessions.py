"""The `/sessions` picker of `localmoe chat`: resume, rename or delete a saved conversation.

Keys in the list: Enter resumes, r renames (an input prefilled with the title: Enter saves, Esc keeps the old
one), d deletes after a confirmation (y deletes, any other key keeps it), Esc goes back. The picker holds no
database: the app gives it `rename(id, title) -> str | None` (the title stored, None on failure) and
`delete(id) -> bool`. Titles are shown through `localmoe.safe_text`, never parsed as markup.
"""

from __future__ import annotations

from collections.abc import Callable

from textual import events
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.content import Content
from textual.screen import ModalScreen
from textual.widgets import Input, Label, OptionList
from textual.widgets.option_list import Option

from localmoe.safe_text import for_line
from localmoe.tui.history import SessionInfo

PICKER_KEYS = "Enter resume · r rename · d delete · Esc back"


def session_line(s: SessionInfo) -> Content:
    msgs = f"{s.message_count} msg" + ("s" if s.message_count != 1 else "")
    return Content(for_line(f"#{s.id}  {s.title or '(empty)'}  · {msgs} · {s.model}"))


class SessionList(OptionList):
    """The saved conversations; r and d act on the highlighted one (only while the list has focus, so typing a
    new title never triggers them)."""

    BINDINGS = [
        Binding("r,f2", "screen.rename", "Rename", show=False),
        Binding("d,delete", "screen.ask_delete", "Delete", show=False),
    ]


class SessionPicker(ModalScreen[int | None]):
    """Pick a saved conversation to resume (its id), or None to go back."""

    BINDINGS = [Binding("escape", "back", "Back", show=False)]

    def __init__(
        self,
        sessions: list[SessionInfo],
        *,
        rename: Callable[[int, str], str | None] | None = None,
        delete: Callable[[int], bool] | None = None,
    ) -> None:
        super().__init__()
        self.sessions = list(sessions)
        self._rename, self._delete = rename, delete
        self.confirming: int | None = None  # the session a delete waits to be confirmed for
        self.renaming: int | None = None

    def compose(self) -> ComposeResult:
        with Vertical(id="picker"):
            yield Label(Content("Saved conversations"), classes="title")
            yield SessionList(*[Option(session_line(s), id=str(s.id)) for s in self.sessions])
            yield Label(Content("No saved conversations yet."), id="picker-empty")
            rename = Input(id="picker-rename", placeholder="New title — Enter saves, Esc keeps the old one")
            rename.display = False
            yield rename
            yield Label(Content(PICKER_KEYS), id="picker-keys")
        self.call_after_refresh(self._show_empty)

    def _show_empty(self) -> None:
        empty = not self.sessions
        self.query_one(SessionList).display = not empty
        self.query_one("#picker-empty").display = empty

    @property
    def keys_line(self) -> str:
        return str(self.query_one("#picker-keys", Label).render())

    def _say(self, text: str, warn: bool = False) -> None:
        label = self.query_one("#picker-keys", Label)
        label.update(Content(for_line(text)))
        label.set_class(warn, "confirm")

    def highlighted(self) -> SessionInfo | None:
        option_list = self.query_one(SessionList)
        index = option_list.highlighted
        return self.sessions[index] if index is not None and 0 <= index < len(self.sessions) else None

    def on_option_list_option_selected(self, event: OptionList.OptionSelected) -> None:
        if self.confirming is None:
            self.dismiss(int(event.option.id or 0))

    # rename --------------------------------------------------------------------------------------

    def action_rename(self) -> None:
        session = self.highlighted()
        if session is None or self._rename is None:
            return
        self.renaming = session.id
        box = self.query_one("#picker-rename", Input)
        box.value = session.title
        box.display = True
        box.focus()
        self._say(f"Rename #{session.id}: Enter saves, Esc keeps “{session.title or '(empty)'}”")

    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        if self.renaming is None or self._rename is None:
            return
        stored = self._rename(self.renaming, event.value)
        if stored is not None:
            index = next(i for i, s in enumerate(self.sessions) if s.id == self.renaming)
            old = self.sessions[index]
            self.sessions[index] = SessionInfo(old.id, stored, old.model, old.system, old.updated_at, old.message_count)
            self.query_one(SessionList).replace_option_prompt_at_index(index, session_line(self.sessions[index]))
        self._end_rename(f"Renamed #{self.renaming}." if stored is not None else "Not renamed.")

    def _end_rename(self, note: str) -> None:
        self.renaming = None
        box = self.query_one("#picker-rename", Input)
        box.display = False
        self.query_one(SessionList).focus()
        self._say(f"{note} {PICKER_KEYS}")

    # delete --------------------------------------------------------------------------------------

    def action_ask_delete(self) -> None:
        session = self.highlighted()
        if session is None or self._delete is None:
            return
        self.confirming = session.id
        self._say(f"Delete #{session.id} “{session.title or '(empty)'}”? y deletes · any other key keeps it", warn=True)

    async def on_key(self, event: events.Key) -> None:
        """While a delete waits for its confirmation, the next key answers it (and does nothing else)."""
        if self.confirming is None:
            return
        event.stop()
        event.prevent_default()
        session_id, self.confirming = self.confirming, None
        if event.key != "y":
            self._say(f"Kept #{session_id}. {PICKER_KEYS}")
            return
        if self._delete is None or not self._delete(session_id):
            self._say(f"#{session_id} was not deleted. {PICKER_KEYS}", warn=True)
            return
        index = next(i for i, s in enumerate(self.sessions) if s.id == session_id)
        del self.sessions[index]
        self.query_one(SessionList).remove_option_at_index(index)
        self._show_empty()
        self._say(f"Deleted #{session_id}. {PICKER_KEYS}")

    def action_back(self) -> None:
        if self.renaming is not None:
            self._end_rename("Not renamed.")
            return
        self.dismiss(None)
