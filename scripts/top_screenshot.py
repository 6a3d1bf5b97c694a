"""The picture of `clusterwatch top` in docs/top.md: the demo, photographed by Textual while a fault is open.

Usage: .venv/bin/python scripts/top_screenshot.py [docs/top.svg]

Starts ``clusterwatch demo`` on free ports, runs top headless against it,
waits until an incident is open and the ranks show it, and saves the Job /
Ranks view as SVG.
"""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
import time
from pathlib import Path

from clusterwatch.tui.app import TopApp
from clusterwatch.tui.views.rows import Tone
from clusterwatch.tui.widgets.table import RowTable

TIMEOUT_S = 120.0


async def photograph(address: str) -> str:
    app = TopApp(address, readonly=False)
    async with app.run_test(size=(120, 30)) as pilot:
        await pilot.press("3")
        table = app.query_one("#rank-table", RowTable)
        deadline = time.monotonic() + TIMEOUT_S
        while not any(r.tone in (Tone.WARNING, Tone.ERROR) for r in table.rows):
            if time.monotonic() > deadline:
                raise RuntimeError("no straggler or hung rank showed up in the demo")
            await pilot.pause(0.2)
        await pilot.pause(1.5)  # a little history in the sparklines
        return app.export_screenshot(title="clusterwatch top on clusterwatch demo")


def main() -> int:
    path = Path(sys.argv[1] if len(sys.argv) > 1 else "docs/top.svg")
    demo = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "clusterwatch",
            "demo",
            "--listen",
            "127.0.0.1:0",
            "--metrics-listen",
            "127.0.0.1:0",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        address = None
        for line in demo.stdout or ():
            found = re.search(r"API \(gRPC\):\s+(\S+)", line)
            if found:
                address = found.group(1)
                break
        if address is None:
            raise RuntimeError("the demo did not print its address")
        path.write_text(asyncio.run(photograph(address)))
    finally:
        demo.terminate()
        demo.wait(30)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
