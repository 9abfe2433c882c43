"""A thinking model's reasoning inside a reply of `localmoe chat`: one header line, collapsed by default.

While the reasoning streams, the header reads "thinking… N words" and one dim line under it shows the latest
text; once the answer starts (or the reply ends) the header reads "Reasoning · N words" and the live line goes.
The block expands and collapses with a click on the header, or Enter / space when the header has focus (Tab and
shift+Tab move focus to it from the input). Like every chat widget, it shows text through `localmoe.safe_text`,
never parsed as markup.
"""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.content import Content
from textual.widgets import Markdown, Static

from localmoe.safe_text import for_line, for_terminal
from localmoe.tui.history import close_fence

COLLAPSED, EXPANDED = "▶", "▼"


class ReasoningHeader(Static, can_focus=True):
    """The clickable, focusable header of a ReasoningView."""

    BINDINGS = [Binding("enter,space", "toggle", "Expand", show=False)]

    def on_click(self) -> None:
        self.action_toggle()

    def action_toggle(self) -> None:
        parent = self.parent
        if isinstance(parent, ReasoningView):
            parent.toggle()


class ReasoningView(Vertical):
    """A reply's reasoning: `text` is exact (what is stored and sent back to the template), what is shown safe."""

    DEFAULT_CSS = """
    ReasoningView { height: auto; margin: 0 0 1 0; }
    ReasoningView ReasoningHeader { color: $text-muted; text-style: italic; width: auto; }
    ReasoningView ReasoningHeader:focus { background: $boost; color: $text; }
    ReasoningView #live { color: $text-muted; height: 1; text-wrap: nowrap; text-overflow: ellipsis; padding: 0 2; }
    ReasoningView Markdown { margin: 0 0 0 2; padding: 0 1; border-left: solid $secondary; color: $text-muted;
                             background: transparent; }
    """

    def __init__(self, text: str = "", *, streaming: bool = False) -> None:
        super().__init__(classes="reasoning")
        self.text = text
        self.streaming = streaming
        self.collapsed = True

    def compose(self) -> ComposeResult:
        yield ReasoningHeader(self._header())
        live = Static("", id="live")
        live.display = self.streaming
        yield live
        body = Markdown("")
        body.display = False
        yield body

    @property
    def words(self) -> int:
        return len(self.text.split())

    def _header(self) -> Content:
        arrow = COLLAPSED if self.collapsed else EXPANDED
        count = f"{self.words} word{'s' if self.words != 1 else ''}"
        label = f"thinking… {count}" if self.streaming else f"Reasoning · {count}"
        return Content(f"{arrow} {label}")

    def _refresh_header(self) -> None:
        if self.is_mounted:
            self.query_one(ReasoningHeader).update(self._header())

    def _live_line(self) -> str:
        """The end of the latest line of reasoning, as wide as the view (the newest words stay in sight)."""
        lines = [line for line in for_terminal(self.text).split("\n") if line.strip()]
        last = for_line(lines[-1]).strip() if lines else ""
        width = max(16, (self.size.width or 80) - 6)
        return last if len(last) <= width else "…" + last[-(width - 1) :]

    async def write(self, text: str) -> None:
        self.text += text
        if not self.is_mounted:
            return
        self._refresh_header()
        if self.streaming:
            self.query_one("#live", Static).update(Content(self._live_line()))
        if not self.collapsed:
            await self.query_one(Markdown).update(close_fence(for_terminal(self.text)))

    async def finish(self) -> None:
        """The reasoning is complete (the answer started, or the reply ended)."""
        if not self.streaming:
            return
        self.streaming = False
        if self.is_mounted:
            self.query_one("#live", Static).display = False
            self._refresh_header()

    def toggle(self) -> None:
        self.collapsed = not self.collapsed
        body = self.query_one(Markdown)
        if not self.collapsed:
            body.update(close_fence(for_terminal(self.text)))
        body.display = not self.collapsed
        self.query_one("#live", Static).display = self.streaming and self.collapsed
        self._refresh_header()
