"""The `blockpress` console script (pyproject.toml's [project.scripts]): blockpress.cli's main, imported and run
under a Ctrl-C handler.

It lives outside the blockpress package so that a Ctrl-C while the package is imported ends quietly (130), as any
other Ctrl-C of a run does. That once meant seconds inside torch's import; the package and the parser import no
torch now (a command imports it when it runs, under blockpress.cli's own handling), so the window is short.
"""

from __future__ import annotations


def main() -> int:
    try:
        from blockpress.cli import main as run

        return run()
    except KeyboardInterrupt:  # while importing or parsing the arguments: quietly, as any other Ctrl-C ends a run
        return 130
