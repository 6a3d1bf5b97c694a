"""What each view shows, as rows built from the TUI's state: pure functions, no Textual."""
