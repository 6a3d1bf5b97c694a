"""The TUI's widgets: a table that renders only the rows on screen, the GPU heat map, the header."""
