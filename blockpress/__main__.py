"""`python -m blockpress`: the `blockpress` command, for an environment whose scripts folder is not on PATH."""

from blockpress.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
