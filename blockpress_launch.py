"""The `blockpress` console script (pyproject.toml's [project.scripts]): blockpress.cli's main, imported and run
under a Ctrl-C handler.

It lives outside the blockpress package because importing any part of it imports torch first, which takes a second
or more: a Ctrl-C then, before blockpress.cli's own handling existed, printed a traceback from inside torch's
import. `import blockpress` stays as it was for the library's users.
"""

from __future__ import annotations


def main() -> int:
    try:
        from blockpress.cli import main as run

        return run()
    except KeyboardInterrupt:  # while importing or parsing the arguments: quietly, as any other Ctrl-C ends a run
        return 130
